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
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .activation_estimate import RowActivations
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

    @property
    def raised(self) -> bool:
        return self.count > self.default_count

    def micro_batch_bytes(self, count: int | None = None) -> int:
        """The estimate for one micro-batch of the largest size at `count` micro-batches (default: the chosen)."""
        return math.ceil(self.rows / (count or self.count)) * self.per_row.total_bytes

    def reason(self) -> str:
        """Why the count, for the start summary: the estimate's largest part per row, and the room left."""
        part, part_bytes = self.per_row.largest_part()
        fits = "" if self.micro_batch_bytes() <= self.free_bytes else ", not even one row fits"
        return (f"{part}: {format_bytes(part_bytes)} a row per layer, {format_bytes(self.per_row.total_bytes)} "
                f"in all, against {format_bytes(self.free_bytes)} free{fits}")


def size_first_pass(per_row: RowActivations, rows: int, seq_len: int, default_count: int, free_bytes: float,
                    choices: Sequence[int]) -> FirstPassSizing:
    """The smallest count of `choices` (or `rows`) from `default_count` up to `rows` whose micro-batch fits
    `free_bytes` ([Note: first-pass micro-batches])."""
    default = min(default_count, rows)
    candidates = sorted({c for c in (*choices, rows) if default <= c <= rows} | {default})
    count = next((c for c in candidates if math.ceil(rows / c) * per_row.total_bytes <= free_bytes),
                 candidates[-1])
    return FirstPassSizing(rows, seq_len, default, count, free_bytes, per_row)
