"""The engine's side of [Note: first-pass micro-batches] (`plan/first_pass_sizing.py`): the room a micro-batch has
on a device before anything was measured, and the sizing of a batch in it.

The room: the budget the measured plan works with (`gpu_memory_budget`, else the smallest GPU's memory, less the
optimizer state placed on the device: `MeasuredPlan.budget_bytes`; CPU workers: the host's available memory),
its `PLAN_SHARE` (the CUDA context, allocator slack and transfers in flight take the rest), less the weights of the
largest stage of the unplanned partition twice (the running task's and the next one's, prefetched while it
computes: `residency.prefetch`) and that stage's gradients.

At large batches the first pass's backward stages are regrouped so that its saved inputs fit the host
([Note: first-pass backward stages] in `plan/first_pass_sizing.py`): the room is read here, the stages' weights
recounted for the regrouped spans.
"""

from __future__ import annotations

from ...plan.activation_estimate import RowActivations, row_activations
from ...plan.first_pass_sizing import (
    SAVED_HOST_SHARE,
    FirstPassSizing,
    regrouped_partition,
    saved_stage_inputs,
    size_first_pass,
)
from ...plan.partition import Partition
from ...plan.shape_costs import shape_from_config
from ..disk import available_memory_bytes
from ..state.host_store import HostStore
from .measured_plan import MICROBATCH_CHOICES, PLAN_SHARE, MeasuredPlan
from .saved_input_room import as_pinned_blocks, pinned_block_bytes


class FirstPassSizer:
    """Sizes unplanned passes for one engine; `model_config` None (not a Hugging Face model) sizes nothing."""

    def __init__(self, model_config, store: HostStore, plan: MeasuredPlan, partition: Partition,
                 regroup: bool = False, saved_on_host: bool = True) -> None:
        """`regroup`: the first pass's backward stages may be regrouped ([Note: first-pass backward stages]: the
        engine's own partition); `saved_on_host`: every saved input goes to host memory (CPU
        workers), else what the device may not keep."""
        self.model_config, self.store, self.plan, self.partition = model_config, store, plan, partition
        self.regroup, self.saved_on_host = regroup, saved_on_host
        pool = store.saved_input_buffers  # where saved inputs land on GPUs ([Note: saved inputs in pooled blocks])
        self.block_of = pool.block_size if pool is not None else pinned_block_bytes
        self.stage_bytes = self._stage_bytes(partition)
        self.element_size = max((b.compute.element_size() for b in store.buckets if b.compute.is_floating_point()),
                                default=4)
        # One sizing per batch shape and budget: every unplanned pass asks (a static plan's every pass), and a count
        # that moved with the host's free memory would change a run's micro-batches, so its rounding and its
        # dropout streams, from one pass to the next. The host's memory is read once, at the first sizing.
        self._sizings: dict[tuple[int, int, int, float | None], FirstPassSizing | None] = {}
        self._host_bytes: float | None = None
        self._pending_bytes: float | None = None  # what the store still allocates, read with the first room

    def _stage_bytes(self, partition: Partition) -> int:
        """The weights of `partition`'s largest stage twice and its gradients."""
        return max(2 * self.store.window_bytes(span.layers) + self.store.window_bytes(span.layers, True)
                   for span in (*partition.forward, *partition.backward))

    def host_bytes(self) -> float:
        """The host memory available at the first sizing (read once: see `size`)."""
        if self._host_bytes is None:
            self._host_bytes = float(available_memory_bytes())
        return self._host_bytes

    def pending_host_bytes(self) -> int:
        """What the store will still allocate in host memory ([Note: first-pass backward stages])."""
        return self.store.bytes_still_to_allocate(self.plan.host_state_bytes)

    def free_bytes(self, stage_bytes: float | None = None) -> float:
        """What one micro-batch's activations may use (see the module docstring); read when sizing, since the
        optimizer's placement, made when it is wrapped, lowers the budget."""
        budget = self.plan.budget_bytes
        if budget is None:  # CPU workers: the host's memory is the device's, as it was at the first sizing
            budget = self.host_bytes()
        return budget * PLAN_SHARE - (self.stage_bytes if stage_bytes is None else stage_bytes)

    def _stage_layers(self, per_row: RowActivations, rows: int, seq_len: int,
                      default_count: int) -> tuple[int, Partition, int, float]:
        """The backward stages' layers for a batch, and the partition they make: the fewest whose saved inputs fit
        the host's share, never more than one row can fit ([Note: first-pass backward stages]). On GPUs a saved
        input is counted as its page-locked block holds it, a block a micro-batch, at the default count (halving a
        micro-batch keeps the ratio): the store's pooled blocks ([Note: saved inputs in pooled blocks]), or
        torch's power-of-two blocks where the pool is off ([Note: saved inputs in the start summary])."""
        if not self.regroup or self.partition.num_layers < 3:
            return 1, self.partition, 0, 0.0
        num_layers = self.partition.num_layers
        try:
            hidden = shape_from_config(self.model_config).hidden_size
        except ValueError:
            return 1, self.partition, 0, 0.0
        input_bytes = rows * seq_len * hidden * self.element_size
        if not self.saved_on_host:
            input_bytes = as_pinned_blocks(input_bytes, [-(-rows // min(default_count, rows)) * seq_len * hidden *
                                                         self.element_size], self.block_of)
        kept = 0 if self.saved_on_host else self.plan.keep_limit_bytes
        # A share of what is available, and never what the store still allocates after it
        host = self.host_bytes()
        if self._pending_bytes is None:  # once, as the host's memory: the stages must not move between passes
            self._pending_bytes = float(self.pending_host_bytes())
        room = max(0.0, min(host * SAVED_HOST_SHARE, host - self._pending_bytes)) + kept
        chosen = 1, self.partition
        for k in range(1, num_layers + 1):
            partition = self.partition if k == 1 else regrouped_partition(num_layers, k)
            if k > 1 and per_row.total_bytes * k > self.free_bytes(self._stage_bytes(partition)):
                break  # one row of k layers does not fit the device: keep the last that did
            chosen = k, partition
            if saved_stage_inputs(num_layers, k) * input_bytes <= room:
                break
        return (*chosen, input_bytes, room)

    def size(self, rows: int, seq_len: int, default_count: int) -> FirstPassSizing | None:
        """The sizing of a batch of `rows` x `seq_len` tokens; None without a decoder config to estimate from."""
        if self.model_config is None:
            return None
        key = (rows, seq_len, default_count, self.plan.budget_bytes)
        if key not in self._sizings:
            per_row = row_activations(self.model_config, seq_len, self.element_size)
            if per_row is None:
                self._sizings[key] = None
            else:
                layers, partition, input_bytes, room = self._stage_layers(per_row, rows, seq_len, default_count)
                self._sizings[key] = size_first_pass(
                    per_row, rows, seq_len, default_count, self.free_bytes(self._stage_bytes(partition)),
                    MICROBATCH_CHOICES, layers, None if layers == 1 else partition, input_bytes, room,
                    inputs_as_allocated=not self.saved_on_host)
        return self._sizings[key]
