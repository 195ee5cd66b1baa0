"""How many micro-batches a pass runs before anything was measured, when `num_microbatches` is unset.

[Note: first-pass micro-batches]
Until the measured plan has chosen ([Note: measured plan]), and under a static plan always, a pass used to run twice
the device count, blind to the batch's shape: GPT-OSS-20B's LoRA at 8 rows of 4096 tokens on a 24 GiB card ran
2 micro-batches of 4 rows, whose eager attention asked for 8 GiB of scores per copy, and Qwen3-30B-A3B at 32 rows
ran 2 of 16; both died of CUDA OOM in the very pass meant to measure them. The count is now the smallest one, never
below that default, whose micro-batch fits what the budget leaves: rows per micro-batch x one layer's transient
per row (`activation_estimate.row_activations`) against `free_bytes`, the planner's share of the device budget less
the weights a stage holds (the engine fills it in: `runtime/execution/first_pass.py`). Candidates are the engine's
micro-batch choices and the row count itself (one row per micro-batch), none above the rows; when not even one row
fits, the largest (one row each) runs, the closest to fitting, and its OOM's message says what to set.

[Note: first-pass backward stages]
The unplanned partition has one layer a backward stage, so its pass keeps every layer's input for the recomputation
([Note: saved inputs]), in host memory during the measured pass: rows x tokens x hidden x the dtype's size each.
At large batches that is more than the host has: Qwen3-4B at one pass of 64 rows of 4,096 tokens kept 36 inputs of
1.25 GiB (45 GiB) beside a 65 GiB store on a 125 GiB machine and was killed for memory; Llama-3.1-8B kept 31 of
2 GiB. So when those inputs would take more than `SAVED_HOST_SHARE` of the host memory available at the first sizing
(the rest is for what allocates after it: the gradients and the optimizer states made at the first step, page-locked
transfers), or more than that memory less what the store will still allocate in it
(`HostStore.bytes_still_to_allocate`: its gradient buffers and optimizer states, which a quarter did not bound: a
host that holds the store with little to spare would keep the inputs and find no room for the first step's states),
the first pass runs backward stages of `stage_layers` layers each, the fewest that fit
(`FirstPassSizer` in runtime/execution/first_pass.py; `saved_stage_inputs` counts them): a stage saves one input,
the fused stage and the bottom one (the token ids) none.
A stage of k layers holds k layers' activations in its backward, so the micro-batch is sized for k layers' estimate
and k never goes past what one row can fit on the device; where that is not enough, the saved-input warning says
so ([Note: saved inputs in host memory]). Only the engine's own unplanned partition is regrouped (no
`forward_stages` or `backward_stages` given); the measured plan replaces it after the first pass, as it replaces the
one-layer stages. Under data parallelism each rank sizes its own host (one process a machine), as each measures its
own plan afterwards: the ranks' stages may differ, and nothing depends on their being the same (the gradient
exchange takes the buckets in one fixed order on every rank, whatever stage produced them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .activation_estimate import RowActivations
from .partition import Partition, plan_partition
from .stage_cost_model import format_bytes


@dataclass(frozen=True)
class FirstPassSizing:
    """The count chosen for a batch of `rows` x `seq_len` and what it was chosen from (plain data)."""

    rows: int
    seq_len: int
    default_count: int  # twice the device count, at most the rows: the count without an estimate
    count: int
    free_bytes: float  # what a micro-batch's activations may use on one device
    per_row: RowActivations
    stage_layers: int = 1  # layers a backward stage of the first pass ([Note: first-pass backward stages])
    partition: Partition | None = None  # the first pass's, when regrouped; None: the engine's unplanned one
    input_bytes: int = 0  # one saved layer input of the batch (rows x tokens x hidden x the dtype's size)
    host_room_bytes: float = 0.0  # what the saved inputs may take of host memory ([Note: first-pass backward stages])
    inputs_as_allocated: bool = False  # input_bytes counts torch's page-locked blocks (GPUs), not the tensors' size

    @property
    def raised(self) -> bool:
        return self.count > self.default_count

    def micro_batch_bytes(self, count: int | None = None) -> int:
        """The estimate for one micro-batch of the largest size at `count` micro-batches (default: the chosen)."""
        return math.ceil(self.rows / (count or self.count)) * self.per_row.total_bytes * self.stage_layers

    def stages_reason(self, num_layers: int) -> str | None:
        """Why the first pass's backward stages hold several layers, for the start summary; None when they do not."""
        if self.stage_layers == 1:
            return None
        return (f"backward stages of {self.stage_layers} layers on the first pass: one-layer stages would keep "
                f"{saved_stage_inputs(num_layers, 1)} layer inputs of {format_bytes(self.input_bytes)}"
                f"{' as allocated' if self.inputs_as_allocated else ''}, more than the "
                f"{format_bytes(self.host_room_bytes)} of host memory allowed them")

    def reason(self) -> str:
        """Why the count, for the start summary: the estimate's largest part per row, and the room left."""
        part, part_bytes = self.per_row.largest_part()
        fits = "" if self.micro_batch_bytes() <= self.free_bytes else ", not even one row fits"
        stages = f", backward stages of {self.stage_layers} layers" if self.stage_layers > 1 else ""
        return (f"{part}: {format_bytes(part_bytes)} a row per layer, {format_bytes(self.per_row.total_bytes)} "
                f"in all{stages}, against {format_bytes(self.free_bytes)} free{fits}")


def size_first_pass(per_row: RowActivations, rows: int, seq_len: int, default_count: int, free_bytes: float,
                    choices: Sequence[int], stage_layers: int = 1, partition: Partition | None = None,
                    input_bytes: int = 0, host_room_bytes: float = 0.0,
                    inputs_as_allocated: bool = False) -> FirstPassSizing:
    """The smallest count of `choices` (or `rows`) from `default_count` up to `rows` whose micro-batch, through
    backward stages of `stage_layers` layers, fits `free_bytes` ([Note: first-pass micro-batches])."""
    default = min(default_count, rows)
    candidates = sorted({c for c in (*choices, rows) if default <= c <= rows} | {default})
    count = next((c for c in candidates if math.ceil(rows / c) * per_row.total_bytes * stage_layers <= free_bytes),
                 candidates[-1])
    return FirstPassSizing(rows, seq_len, default, count, free_bytes, per_row, stage_layers, partition, input_bytes,
                           host_room_bytes, inputs_as_allocated)


SAVED_HOST_SHARE = 0.25  # of the host memory available at the first sizing ([Note: first-pass backward stages])


def saved_stage_inputs(num_layers: int, stage_layers: int) -> int:
    """Inputs a pass saves with backward stages of `stage_layers` layers packed from the top: one a stage but the
    fused one (the top) and the bottom one (layer 0's input is the caller's token ids)."""
    return max(0, math.ceil(num_layers / stage_layers) - 2)


def regrouped_partition(num_layers: int, stage_layers: int) -> Partition:
    """The unplanned partition with backward stages of `stage_layers` layers from the top (the bottom one holds the
    rest) and its forward stages packed as the unplanned partition packs them."""
    counts = [stage_layers] * (num_layers // stage_layers)
    if num_layers % stage_layers:
        counts.insert(0, num_layers % stage_layers)
    return plan_partition(num_layers, backward_stages=counts)
