"""The micro-batch count of a measured plan: the fastest predicted iteration, transfers included, and whether the
plan that runs is transfer-bound ([Note: transfers sized to the batch] in `transfer_budget.py`).

[Note: micro-batches chosen for transfers]
For each candidate count M (micro-batches of rows/M rows each, in rounds of `microbatches_per_round`, one round when
it is unset) the partition is planned for micro-batches of that size (`plan_one_device` on one device,
`plan_from_costs` on several), every stage costed by the stage cost model (the slower of its compute, its uploads
and its downloads), and the pass replayed round after round on the ring of devices (the replay of
`simulate.simulate` over `build_schedule`'s tasks; a test checks the two agree). The shortest predicted pass wins;
equal ones (within a relative 1e-9): the fewest micro-batches, which are larger and keep the GPU busier per kernel
and per Python call. The measured plan offers its own count and the smaller ones (`fewer_microbatches`): fewer,
larger micro-batches mean fewer rounds, so fewer uploads of every weight when rounds are set, at the cost of a longer
fill of the ring. With a single round the uploads do not depend on the count at all; then only the batch hides them,
and the summary says which batch would.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from .layer_costs import LayerCosts
from .one_device import plan_one_device
from .partition import Partition
from .planned_partition import PlannedPartition
from .planner import plan_from_costs
from .schedule import Mode, round_spans, stage_sequence
from .stage_cost_model import PlanSettings, StageCostModel, format_bytes
from .transfer_budget import StageTransfer, TransferBudget, format_rate, stage_transfers

_RELATIVE_TIE = 1e-9  # predicted times this close are equal: sums of the same costs in another order


def fewer_microbatches(count: int, rows: int, choices: Sequence[int]) -> list[int]:
    """`count` and every one of `choices` below it, none above `rows`, ascending."""
    return sorted(c for c in {*choices, count} if 1 <= c <= min(count, rows))


def predicted_pass_s(partition: Partition, costs: LayerCosts, settings: PlanSettings, num_microbatches: int,
                     microbatches_per_round: int | None) -> float:
    """One training pass of `num_microbatches` micro-batches (costs per micro-batch: `costs`), in rounds of
    `microbatches_per_round` (None: one round), every task taking the stage cost model's time for its round, the
    rounds one after another on the ring as `build_schedule` lays them out (the slot rolls on)."""
    n = settings.num_devices
    stages = stage_sequence(partition, Mode.TRAIN)
    per_mb_of: dict[int, list[float]] = {}  # round size -> each stage's time per micro-batch
    device_free = [0.0] * n
    slot = 0
    for mbs in round_spans(num_microbatches, microbatches_per_round or num_microbatches):
        m = len(mbs)
        per_mb = per_mb_of.get(m)
        if per_mb is None:
            model = StageCostModel(costs, dataclasses.replace(settings, num_microbatches=m))
            per_mb = per_mb_of[m] = [model.time(kind, *span) / m for kind, _, span in stages]
        ready = [0.0] * m  # when micro-batch j left the round's previous task (rounds do not wait for each other)
        for duration in per_mb:
            device = slot % n
            slot += 1
            clock = device_free[device]
            for j in range(m):
                clock = max(clock, ready[j]) + duration
                ready[j] = clock
            device_free[device] = clock
    return max(device_free)


@dataclass(frozen=True)
class TransferPlan:
    """The chosen micro-batch count, its plan, what each of its stages moves against what it computes, and the
    predicted pass of every candidate that fits memory ([Note: micro-batches chosen for transfers])."""

    rows: int
    num_microbatches: int
    microbatches_per_round: int | None  # the setting; None: one round
    planned: PlannedPartition
    stages: tuple[StageTransfer, ...]
    predicted_s: tuple[tuple[int, float], ...]  # (count, predicted pass seconds), ascending counts
    budget: TransferBudget

    @property
    def rows_per_microbatch(self) -> float:
        return self.rows / self.num_microbatches

    @property
    def microbatches_per_task(self) -> int:
        """Micro-batches one task (a round) runs: the rows a weight upload is amortised over, in micro-batches."""
        return min(self.microbatches_per_round or self.num_microbatches, self.num_microbatches)

    @property
    def transfer_bound(self) -> bool:
        """Some stage's upload or download takes longer than its compute at the chosen micro-batches."""
        return any(not s.hides for s in self.stages)

    @property
    def rows_per_microbatch_to_hide(self) -> int | None:
        """The fewest rows per micro-batch (at the chosen count and rounds) for which every stage's transfers hide;
        None when no batch hides them (activations alone cross slower than they are computed)."""
        needed = max(s.rows_to_hide for s in self.stages)
        if math.isinf(needed):
            return None
        per_mb = needed / self.microbatches_per_task
        return max(1, math.ceil(per_mb - 1e-9 * per_mb))

    @property
    def batch_to_hide(self) -> int | None:
        """The batch (rows per pass) that gives `rows_per_microbatch_to_hide` rows to each chosen micro-batch. Exact
        for these stages; the re-plan at that batch may cut them otherwise (larger micro-batches take more
        memory)."""
        per_mb = self.rows_per_microbatch_to_hide
        return None if per_mb is None else per_mb * self.num_microbatches

    def summary(self) -> str:
        """One line for the start summary: transfer-bound or not, the stage that binds, the batch that would hide."""
        rounds = "one round" if self.microbatches_per_task == self.num_microbatches else \
            f"rounds of {self.microbatches_per_task}"
        plural = "es" if self.num_microbatches > 1 else ""
        row_s = "" if self.rows_per_microbatch == 1 else "s"
        at = (f"{self.num_microbatches} micro-batch{plural} of {self.rows_per_microbatch:g} row{row_s} ({rounds}), "
              f"uploads at {format_rate(self.budget.bytes_per_s)} ({self.budget.rate_source})")
        worst = max(self.stages, key=lambda s: (s.exposed_s, max(s.upload_s, s.download_s) / (s.compute_s or 1e-30)))
        moved = f"{worst.name} ({worst.span}) moves its weights in {_ms(worst.upload_s)}, its gradients in " \
                f"{_ms(worst.download_s)}, against {_ms(worst.compute_s)} of compute"
        if not self.transfer_bound:
            return f"uploads hide under compute at {at}; the tightest stage, {moved}"
        per_mb = self.rows_per_microbatch_to_hide
        if per_mb is None:
            fix = ("no batch hides it: its activations alone cross PCIe slower than it computes them (larger stages "
                   "compute more per crossing: a larger gpu_memory_budget, or forward_stages/backward_stages)")
        else:
            fix = (f"a batch of {self.batch_to_hide} rows ({per_mb} per micro-batch) would hide it"
                   + ("" if self.microbatches_per_task == self.num_microbatches else
                      ", as would larger rounds (microbatches_per_round)"))
        return f"transfer-bound at {at}: {moved}; {fix}"

    def __str__(self) -> str:
        lines = [self.summary(),
                 "predicted pass by micro-batch count: "
                 + ", ".join(f"{c}: {_ms(s)}" + (" <- chosen" if c == self.num_microbatches else "")
                             for c, s in self.predicted_s),
                 f"{'stage':<6} {'layers':<10} {'compute':>11} {'upload':>11} {'download':>11} "
                 f"{'rows to hide':>12}  weights up"]
        weights = self.budget.costs.upload_bytes
        for s in self.stages:
            lines.append(f"{s.name:<6} {str(s.span):<10} {_ms(s.compute_s):>11} {_ms(s.upload_s):>11} "
                         f"{_ms(s.download_s):>11} {s.rows_to_hide:>12.1f}  "
                         f"{format_bytes(sum(weights[s.span.start:s.span.stop]))}"
                         + ("" if s.hides else "  <- transfer-bound"))
        return "\n".join(lines)


def choose_microbatches(budget: TransferBudget, rows: int, num_devices: int, candidates: Sequence[int],
                        gpu_memory_bytes: float, microbatches_per_round: int | None = None,
                        recompute: str = "stage") -> TransferPlan:
    """The candidate micro-batch count whose planned pass over `rows` rows is predicted shortest, with its plan and
    the transfer verdict of its stages ([Note: micro-batches chosen for transfers]). Raises ValueError (the
    planner's, naming the layer and the knobs) when no candidate fits `gpu_memory_bytes`."""
    if rows < 1 or not candidates or min(candidates) < 1:
        raise ValueError(f"choose_microbatches needs rows >= 1 and candidate counts >= 1, got rows={rows}, "
                         f"candidates={list(candidates)}.")
    planner = plan_one_device if num_devices == 1 else plan_from_costs
    found: list[tuple[float, int, PlannedPartition]] = []
    error: ValueError | None = None
    for count in sorted(set(candidates)):
        costs = budget.costs_at(rows / count)
        settings = PlanSettings(num_devices=num_devices,
                                num_microbatches=min(microbatches_per_round or count, count),
                                gpu_memory_bytes=gpu_memory_bytes, pcie_bytes_per_s=budget.bytes_per_s,
                                recompute=recompute)
        try:
            planned = planner(costs, settings)
        except ValueError as exc:  # this size does not fit; a smaller one may
            error = exc
            continue
        found.append((predicted_pass_s(planned.partition, costs, settings, count, microbatches_per_round), count,
                      planned))
    if not found:
        raise error  # type: ignore[misc]  # candidates is not empty, so every one raised
    best_s, best_count, best = found[0]
    for time_s, count, planned in found[1:]:  # ascending counts: a tie keeps the fewer micro-batches
        if time_s < best_s and not abs(time_s - best_s) <= _RELATIVE_TIE * best_s:
            best_s, best_count, best = time_s, count, planned
    per_task = min(microbatches_per_round or best_count, best_count)
    return TransferPlan(rows, best_count, microbatches_per_round, best,
                        stage_transfers(budget, best, rows / best_count * per_task),
                        tuple((c, t) for t, c, _ in found), budget)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"
