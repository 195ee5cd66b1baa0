"""The engine's side of [Note: first-pass micro-batches] (`plan/first_pass_sizing.py`): the room a micro-batch has
on a device before anything was measured, and the sizing of a batch in it.

The room: the budget the measured plan works with (`gpu_memory_budget`, else the smallest GPU's memory, less the
optimizer state placed on the device: `MeasuredPlan.budget_bytes`; CPU workers: the host's available memory),
its `PLAN_SHARE` (the CUDA context, allocator slack and transfers in flight take the rest), less the weights of the
largest stage of the unplanned partition twice (the running task's and the next one's, prefetched while it
computes: `residency.prefetch`) and that stage's gradients.
"""

from __future__ import annotations

from ...plan.activation_estimate import row_activations
from ...plan.first_pass_sizing import FirstPassSizing, size_first_pass
from ...plan.partition import Partition
from ..disk import available_memory_bytes
from ..state.host_store import HostStore
from .measured_plan import MICROBATCH_CHOICES, PLAN_SHARE, MeasuredPlan


class FirstPassSizer:
    """Sizes unplanned passes for one engine; `model_config` None (not a Hugging Face model) sizes nothing."""

    def __init__(self, model_config, store: HostStore, plan: MeasuredPlan, partition: Partition) -> None:
        self.model_config, self.store, self.plan = model_config, store, plan
        spans = (*partition.forward, *partition.backward)
        self.stage_bytes = max(2 * store.window_bytes(span.layers) + store.window_bytes(span.layers, True)
                               for span in spans)
        self.element_size = max((b.compute.element_size() for b in store.buckets if b.compute.is_floating_point()),
                                default=4)
        # One sizing per batch shape and budget: every unplanned pass asks (a static plan's every pass), and a count
        # that moved with the host's free memory would change a run's micro-batches, so its rounding and its
        # dropout streams, from one pass to the next. The host's memory is read once, at the first sizing.
        self._sizings: dict[tuple[int, int, int, float | None], FirstPassSizing | None] = {}
        self._host_bytes: float | None = None

    def free_bytes(self) -> float:
        """What one micro-batch's activations may use (see the module docstring); read when sizing, since the
        optimizer's placement, made when it is wrapped, lowers the budget."""
        budget = self.plan.budget_bytes
        if budget is None:  # CPU workers: the host's memory is the device's, as it was at the first sizing
            if self._host_bytes is None:
                self._host_bytes = float(available_memory_bytes())
            budget = self._host_bytes
        return budget * PLAN_SHARE - self.stage_bytes

    def size(self, rows: int, seq_len: int, default_count: int) -> FirstPassSizing | None:
        """The sizing of a batch of `rows` x `seq_len` tokens; None without a decoder config to estimate from."""
        if self.model_config is None:
            return None
        key = (rows, seq_len, default_count, self.plan.budget_bytes)
        if key not in self._sizings:
            per_row = row_activations(self.model_config, seq_len, self.element_size)
            self._sizings[key] = None if per_row is None else size_first_pass(
                per_row, rows, seq_len, default_count, self.free_bytes(), MICROBATCH_CHOICES)
        return self._sizings[key]
