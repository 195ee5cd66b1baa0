"""What each layer moves over PCIe against what it computes, as plain data: the bytes-to-FLOPs reasoning of a plan.

[Note: transfers sized to the batch]
A task runs one stage over the micro-batches of one round and uploads the stage's weights once for all of them
(and downloads its gradients once), while its compute grows with the rows it runs. So a weight upload is amortised
over the rows of a round: with the default single round per pass, over the whole batch; with
`microbatches_per_round` set, over that many micro-batches. The size of a micro-batch by itself changes nothing
(it only moves rows between micro-batches of the same round), except through the number of rounds. For a task of
R rows (m micro-batches of r rows, R = m r), with c its compute per row, W and G its weight and gradient bytes,
a and d the activation bytes per row it uploads and downloads, and b the measured upload rate (PCIe is full duplex
and symmetric, so downloads are taken at the same rate):

    compute = R c        upload = (W + R a) / b        download = (G + R d) / b

and its transfers hide under its compute from R >= W / (b c - a) (and likewise for G, d). If b c <= a the
activations alone cross slower than the task computes them and no batch hides it. A dense decoder layer computes
about 6 FLOPs per weight per token, so a few rows of thousands of tokens hide its weights; a mixture-of-experts
layer uploads every expert's weights for the FLOPs of the few experts each token uses (Qwen3-30B-A3B: about 10x
the bytes per FLOP of a dense layer, the paper's "8 sequences dense, 80 MoE"). A forward stage is the hardest to
hide: it uploads the weights for the forward alone, a third of what the backward computes.

The numbers come from the measured pass ([Note: measured plan]): every layer's compute per micro-batch, timed on
the device, divided by the rows of the measured micro-batches (compute is taken to grow in proportion to the rows;
larger micro-batches often run a little faster per row, so a threshold is if anything an underestimate), the bytes
its tasks move (the store's row windows), and the upload rate measured over that pass's weight uploads.
`microbatch_choice.choose_microbatches` uses them to choose the micro-batch count and says whether the plan is
transfer-bound.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from .layer_costs import LayerCosts
from .partition import Span
from .planned_partition import PlannedPartition
from .schedule import TaskKind
from .stage_cost_model import PlanSettings, StageCostModel, format_bytes

# Fields of `LayerCosts` that grow with the rows of a micro-batch; the weight and gradient bytes do not.
_PER_ROW_FIELDS = ("forward_s", "backward_s", "recompute_s", "act_bytes", "input_bytes", "work_bytes")
# [Note: memory scaled down at most 4x]
# A layer's activation and working memory, measured at one micro-batch size, scales with the rows only in part: the
# head's loss chunks (1,024 tokens x the vocabulary in float32, with their gradient) and the kernels' workspaces do
# not shrink with the batch, and one measurement cannot tell the two parts apart. Scaled in proportion from 16 rows
# to 1, Qwen3-4B's 8-layer fused stage was planned within 10.4 GiB and ran out of a 13 GiB card (64 rows a step,
# 2026-12-06). So below `MEMORY_SCALE_FLOOR` of the measured rows, memory is taken at that share of the measured
# (times and the layer inputs, which are the hidden states, still scale in proportion): the planner can still choose
# micro-batches of a quarter of the measured rows as they are, and smaller ones costed as if a quarter.
MEMORY_SCALE_FLOOR = 0.25
_MEMORY_FIELDS = frozenset({"act_bytes", "work_bytes"})


def _rows_to_hide(fixed: float, per_row: float, compute_per_row: float, bytes_per_s: float) -> float:
    """The fewest rows R for which (fixed + R per_row) / bytes_per_s <= R compute_per_row; inf if none."""
    if fixed <= 0 and per_row <= bytes_per_s * compute_per_row:
        return 0.0
    margin = bytes_per_s * compute_per_row - per_row
    return fixed / margin if margin > 0 else math.inf


@dataclass(frozen=True)
class LayerTransfer:
    """One layer's bytes against its compute: what it uploads and downloads per task, its compute per row."""

    layer: int
    upload_bytes: float  # its weights, host to GPU, once per task that runs it (what crosses PCIe)
    download_bytes: float  # its gradients, GPU to host, once per backward or fused task
    forward_s_per_row: float
    recompute_s_per_row: float
    backward_s_per_row: float
    upload_s: float  # upload_bytes at the upload rate

    @property
    def rows_to_hide_forward(self) -> float:
        """Rows one task must run for the layer's upload to hide under its own forward: its bytes-to-FLOPs ratio,
        in rows (inf for a layer that uploads weights and computes nothing, such as an embedding lookup)."""
        return _ratio(self.upload_s, self.forward_s_per_row)

    @property
    def rows_to_hide_fused(self) -> float:
        """The same under its forward and backward (a layer of the fused stage, uploaded once)."""
        return _ratio(self.upload_s, self.forward_s_per_row + self.backward_s_per_row)


def _ratio(seconds: float, per_row: float) -> float:
    if seconds <= 0:
        return 0.0
    return seconds / per_row if per_row > 0 else math.inf


@dataclass(frozen=True)
class TransferBudget:
    """The measured costs of a pass, the rows of its micro-batches and the upload rate: enough to cost any stage at
    any micro-batch size ([Note: transfers sized to the batch]).

    Fields:
        costs: the measured `LayerCosts` (times and activation bytes of one micro-batch of `rows_per_microbatch`).
        rows_per_microbatch: the mean rows of the measured micro-batches.
        bytes_per_s: the upload rate, also used for downloads (PCIe is full duplex and symmetric).
        rate_source: "measured" (over the measured pass's weight uploads) or "assumed" (nothing could be timed).
    """

    costs: LayerCosts
    rows_per_microbatch: float
    bytes_per_s: float
    rate_source: str = "measured"

    def __post_init__(self) -> None:
        if not self.rows_per_microbatch > 0 or not self.bytes_per_s > 0:
            raise ValueError(f"TransferBudget needs rows_per_microbatch > 0 and bytes_per_s > 0, got "
                             f"{self.rows_per_microbatch!r} and {self.bytes_per_s!r}.")

    def costs_at(self, rows_per_microbatch: float) -> LayerCosts:
        """The costs of micro-batches of `rows_per_microbatch` rows: times, layer inputs and activation bytes in
        proportion, activation and working memory no lower than `MEMORY_SCALE_FLOOR` of the measured
        ([Note: memory scaled down at most 4x])."""
        scale = rows_per_microbatch / self.rows_per_microbatch
        if scale == 1:
            return self.costs
        memory_scale = max(scale, MEMORY_SCALE_FLOOR)
        return dataclasses.replace(self.costs, **{
            name: [v * (memory_scale if name in _MEMORY_FIELDS else scale) for v in getattr(self.costs, name)]
            for name in _PER_ROW_FIELDS})

    @property
    def layers(self) -> tuple[LayerTransfer, ...]:
        row = self.costs_at(1.0)
        return tuple(LayerTransfer(i, row.upload_bytes[i], row.download_bytes[i], row.forward_s[i],
                                   row.recompute_s[i], row.backward_s[i], row.upload_bytes[i] / self.bytes_per_s)
                     for i in range(row.num_layers))

    def __str__(self) -> str:
        lines = [f"upload rate {format_rate(self.bytes_per_s)} ({self.rate_source}); per layer, compute per row of "
                 f"{self.rows_per_microbatch:g}-row micro-batches:",
                 f"{'layer':>5} {'up':>12} {'down':>12} {'upload':>10} {'fwd/row':>10} {'bwd/row':>10} "
                 f"{'rows to hide (fwd)':>18}"]
        for t in self.layers:
            lines.append(f"{t.layer:>5} {format_bytes(t.upload_bytes):>12} {format_bytes(t.download_bytes):>12} "
                         f"{_ms(t.upload_s):>10} {_ms(t.forward_s_per_row):>10} {_ms(t.backward_s_per_row):>10} "
                         f"{t.rows_to_hide_forward:>18.1f}")
        return "\n".join(lines)


@dataclass(frozen=True)
class StageTransfer:
    """One stage's task at the rows it runs: its compute against its transfers, and the rows that would hide them."""

    name: str  # as the schedule writes it: F0, FB3, B1
    span: Span
    rows_per_task: float
    compute_s: float
    upload_s: float
    download_s: float
    rows_to_hide: float  # rows per task from which both transfers hide under the compute (inf: no batch does)

    @property
    def hides(self) -> bool:
        return self.rows_per_task >= self.rows_to_hide

    @property
    def exposed_s(self) -> float:
        """How much longer the slower transfer takes than the compute (0 when they hide)."""
        return max(0.0, self.upload_s - self.compute_s, self.download_s - self.compute_s)


def stage_transfers(budget: TransferBudget, planned: PlannedPartition,
                    rows_per_task: float) -> tuple[StageTransfer, ...]:
    """Every stage of `planned` in round order, its task running `rows_per_task` rows."""
    settings: PlanSettings = planned.settings
    per_row = StageCostModel(budget.costs_at(1.0), dataclasses.replace(settings, num_microbatches=1,
                                                                       pcie_bytes_per_s=budget.bytes_per_s))
    rate = budget.bytes_per_s
    kinds = {"F": TaskKind.FORWARD, "FB": TaskKind.FUSED, "B": TaskKind.BACKWARD}
    stages = []
    for name, span, _, _ in planned.rows():
        kind = kinds[name.rstrip("0123456789")]
        compute = per_row.compute(kind, span.start, span.stop)  # one micro-batch of one row
        up_task, up_row, down_task, down_row = per_row.transfer_bytes(kind, span.start, span.stop)
        stages.append(StageTransfer(
            name, span, rows_per_task, rows_per_task * compute, (up_task + rows_per_task * up_row) / rate,
            (down_task + rows_per_task * down_row) / rate,
            max(_rows_to_hide(up_task, up_row, compute, rate), _rows_to_hide(down_task, down_row, compute, rate))))
    return tuple(stages)


def format_rate(bytes_per_s: float) -> str:
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bytes_per_s >= scale / 10:
            return f"{bytes_per_s / scale:.1f} {unit}"
    return f"{bytes_per_s:.0f} B/s"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"
