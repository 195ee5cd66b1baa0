"""Classic weight-bound pipeline schedules as data, and one simulator for them and for RoundPipe.

A classic schedule binds each stage to one device for both its forward and its backward (GPipe, 1F1B, interleaved
1F1B and looped BFS, the last two with several "virtual" stages per device). Each device runs a list of operations
`(kind, stage, micro-batch)` in order; an operation starts when its device is free and its input is ready:
F(s, m) after F(s-1, m); B(s, m) after B(s+1, m), and B(last, m) after F(last, m).

`compare_bubbles` puts them beside RoundPipe (sync: one iteration with its warm-up and cool-down; async: the steady
state of iterations that flow into each other, the optimizer step running beside the next iteration). A classic
schedule binds one stage to a device, so some counts cannot be built (more stages than layers; interleaved 1F1B's
micro-batches not in whole groups of the device count): its builder raises `ScheduleNotBuilt` and the comparison
holds a `NotBuilt` saying why in its place. RoundPipe has no such limit: its numbers are always there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .partition import DEFAULT_BACKWARD_TO_FORWARD_COST, Span, plan_partition
from .schedule import TaskKind, build_schedule
from .simulate import simulate

Op = tuple[str, int, int]  # ("F" | "B", stage, micro-batch)


@dataclass(frozen=True)
class ClassicSchedule:
    name: str
    stages: tuple[Span, ...]  # layer spans, stage s on device s % num_devices
    device_ops: tuple[tuple[Op, ...], ...]


class ScheduleNotBuilt(ValueError):
    """A classic schedule that cannot be built for these counts; `reason` says why ("needs ...")."""

    def __init__(self, schedule: str, reason: str):
        super().__init__(f"{schedule} {reason}.")
        self.reason = reason


@dataclass(frozen=True)
class NotBuilt:
    """In `compare_bubbles`'s result: this schedule could not be built, and why (printed as "n/a: <why>")."""
    reason: str

    def __str__(self) -> str:
        return f"n/a: {self.reason}"


def _stage_spans(schedule: str, costs: Sequence[float], num_devices: int, chunks: int | None = None
                 ) -> tuple[Span, ...]:
    """One stage per device (`chunks` per device for the virtual-stage schedules), each at least one layer."""
    stages = num_devices * (chunks or 1)
    if stages > len(costs):
        per = f"{num_devices} devices x {chunks} chunks" if chunks else "one per device"
        raise ScheduleNotBuilt(schedule, f"needs {stages} stages ({per}), more than the {len(costs)} layers")
    return balanced_spans(costs, stages)


def balanced_spans(costs: Sequence[float], num_stages: int) -> tuple[Span, ...]:
    """Contiguous spans minimising the most expensive stage (binary search on the budget, greedy packing)."""
    if num_stages > len(costs):
        raise ValueError(f"{num_stages} stages for {len(costs)} layers: use fewer devices or virtual stages.")

    def pack(budget: float) -> list[int] | None:
        counts, total = [], 0.0
        for i, cost in enumerate(costs):
            if counts and total + cost <= budget and len(costs) - i > num_stages - len(counts):
                counts[-1] += 1
                total += cost
            else:
                counts.append(1)
                total = cost
        return counts if len(counts) <= num_stages and max(costs) <= budget else None

    lo, hi = max(costs), sum(costs)
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if pack(mid) else (mid, hi)
    counts = pack(hi)
    while len(counts) < num_stages:  # split the largest stage so every device gets work
        i = max(range(len(counts)), key=lambda k: counts[k])
        counts[i:i + 1] = [counts[i] // 2, counts[i] - counts[i] // 2]
    spans, start = [], 0
    for count in counts:
        spans.append(Span(start, start + count))
        start += count
    return tuple(spans)


def gpipe(num_devices: int, num_microbatches: int, costs: Sequence[float]) -> ClassicSchedule:
    stages = _stage_spans("GPipe", costs, num_devices)
    ops = tuple(tuple([("F", d, m) for m in range(num_microbatches)] + [("B", d, m) for m in range(num_microbatches)])
                for d in range(num_devices))
    return ClassicSchedule("gpipe", stages, ops)


def one_f_one_b(num_devices: int, num_microbatches: int, costs: Sequence[float]) -> ClassicSchedule:
    stages = _stage_spans("1F1B", costs, num_devices)
    ops = []
    for d in range(num_devices):
        warmup = min(num_devices - d - 1, num_microbatches)
        seq: list[Op] = [("F", d, m) for m in range(warmup)]
        f, b = warmup, 0
        while b < num_microbatches:
            if f < num_microbatches:
                seq.append(("F", d, f))
                f += 1
            seq.append(("B", d, b))
            b += 1
        ops.append(tuple(seq))
    return ClassicSchedule("1f1b", stages, tuple(ops))


def interleaved_one_f_one_b(num_devices: int, num_microbatches: int, costs: Sequence[float],
                            chunks: int = 2) -> ClassicSchedule:
    """Megatron's interleaved 1F1B: `chunks` virtual stages per device, micro-batches in groups of N."""
    if num_microbatches % num_devices:
        raise ScheduleNotBuilt("interleaved 1F1B", f"needs micro-batches a multiple of devices ({num_microbatches} "
                                                   f"micro-batches on {num_devices} devices)")
    stages = _stage_spans("interleaved 1F1B", costs, num_devices, chunks)
    total = num_microbatches * chunks

    def virtual(k: int, forward: bool) -> tuple[int, int]:
        group, within = divmod(k, num_devices * chunks)
        chunk = within // num_devices
        chunk = chunk if forward else chunks - 1 - chunk
        return chunk, group * num_devices + within % num_devices

    ops = []
    for d in range(num_devices):
        warmup = min(total, (chunks - 1) * num_devices + 2 * (num_devices - d - 1))
        seq: list[Op] = []
        f = b = 0
        for _ in range(warmup):
            chunk, m = virtual(f, True)
            seq.append(("F", chunk * num_devices + d, m))
            f += 1
        while b < total:
            if f < total:
                chunk, m = virtual(f, True)
                seq.append(("F", chunk * num_devices + d, m))
                f += 1
            chunk, m = virtual(b, False)
            seq.append(("B", chunk * num_devices + d, m))
            b += 1
        ops.append(tuple(seq))
    return ClassicSchedule("interleaved_1f1b", stages, tuple(ops))


def looped_bfs(num_devices: int, num_microbatches: int, costs: Sequence[float], chunks: int = 2) -> ClassicSchedule:
    """Breadth-first looping: every micro-batch through a device's first chunk, then its next chunk, ...; the
    backward in reverse."""
    stages = _stage_spans("looped BFS", costs, num_devices, chunks)
    ops = []
    for d in range(num_devices):
        own = [c * num_devices + d for c in range(chunks)]
        seq = [("F", s, m) for s in own for m in range(num_microbatches)]
        seq += [("B", s, m) for s in reversed(own) for m in range(num_microbatches)]
        ops.append(tuple(seq))
    return ClassicSchedule("looped_bfs", stages, tuple(ops))


def simulate_classic(schedule: ClassicSchedule, costs: Sequence[float],
                     backward_ratio: float = DEFAULT_BACKWARD_TO_FORWARD_COST) -> float:
    """Bubble ratio of one iteration (list scheduling; raises if the schedule cannot make progress)."""
    stage_cost = [sum(costs[s.start:s.stop]) for s in schedule.stages]
    last = len(schedule.stages) - 1
    done: dict[Op, float] = {}
    position = [0] * len(schedule.device_ops)
    free = [0.0] * len(schedule.device_ops)
    busy = [0.0] * len(schedule.device_ops)
    remaining = sum(len(ops) for ops in schedule.device_ops)
    while remaining:
        progressed = False
        for d, ops in enumerate(schedule.device_ops):
            while position[d] < len(ops):
                kind, stage, mb = ops[position[d]]
                needs = ("F", stage - 1, mb) if kind == "F" else (("B", stage + 1, mb) if stage < last
                                                                   else ("F", stage, mb))
                if kind == "F" and stage == 0:
                    ready = 0.0
                elif needs in done:
                    ready = done[needs]
                else:
                    break
                duration = stage_cost[stage] * (1.0 if kind == "F" else backward_ratio)
                start = max(free[d], ready)
                done[(kind, stage, mb)] = free[d] = start + duration
                busy[d] += duration
                position[d] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {schedule.name} is not progressing (deadlock) at positions {position}")
    makespan = max(free)
    return 1.0 - sum(busy) / (makespan * len(busy))


def roundpipe_partition(costs: Sequence[float], backward_ratio: float = DEFAULT_BACKWARD_TO_FORWARD_COST):
    """RoundPipe's partition for compute-only forward `costs`, each backward at `backward_ratio` times its forward."""
    return plan_partition(len(costs), forward_costs=costs, backward_costs=[backward_ratio * c for c in costs])


def roundpipe_bubble(num_devices: int, num_microbatches: int, costs: Sequence[float], asynchronous: bool,
                     backward_ratio: float = DEFAULT_BACKWARD_TO_FORWARD_COST, iterations: int = 8) -> float:
    """Sync: one iteration (warm-up and cool-down each time). Async: `iterations` iterations back to back, the
    pipeline never drained (the lagged step needs no barrier), measured over the whole run."""
    partition = roundpipe_partition(costs, backward_ratio)
    return _roundpipe_partition_bubble(partition, costs, num_devices, num_microbatches, asynchronous,
                                       backward_ratio, iterations)


def _roundpipe_partition_bubble(partition, costs: Sequence[float], num_devices: int, num_microbatches: int,
                                asynchronous: bool, backward_ratio: float, iterations: int) -> float:
    runs = iterations if asynchronous else 1
    tasks = []
    start = 0
    for it in range(runs):
        one = build_schedule(partition, num_microbatches, num_microbatches, num_devices, start_device=start)
        start = (one[-1].device_index + 1) % num_devices
        tasks += [t._replace(round_index=it) for t in one]  # one round per iteration: a chain of its own

    def cost(task, mb):
        span = sum(costs[task.span.start:task.span.stop])
        return span if task.kind is TaskKind.FORWARD else span * backward_ratio

    return simulate(tasks, num_devices, cost).bubble_ratio


def split_head_plan(num_devices: int, num_microbatches: int, costs: Sequence[float], asynchronous: bool,
                    backward_ratio: float = DEFAULT_BACKWARD_TO_FORWARD_COST, max_head_shards: int = 16,
                    iterations: int = 8):
    """The planner's plan for compute-only `costs` (the last one the LM head) with the head in vocabulary shards
    ([Note: split head]) and the stage counts that fill the ring ([Note: filling the ring]) for the sync (one
    iteration) or async (`iterations` back to back) run. Returns (SplitHeadPlan, filled PlannedPartition)."""
    from .head_split import plan_split_head
    from .layer_costs import LayerCosts
    from .ring_fill import fill_ring
    from .stage_cost_model import PlanSettings

    layer_costs = LayerCosts(forward_s=list(costs), backward_s=[(backward_ratio - 1) * c for c in costs])
    settings = PlanSettings(num_devices=num_devices, num_microbatches=num_microbatches, gpu_memory_bytes=math.inf,
                            pcie_bytes_per_s=math.inf)
    split = plan_split_head(layer_costs, settings, max_head_shards)
    return split, fill_ring(split.planned, split.costs, iterations if asynchronous else 1)


def roundpipe_split_head_bubble(num_devices: int, num_microbatches: int, costs: Sequence[float], asynchronous: bool,
                                backward_ratio: float = DEFAULT_BACKWARD_TO_FORWARD_COST, iterations: int = 8,
                                max_head_shards: int = 16) -> float:
    """`roundpipe_bubble` with the head in vocabulary shards, planned by `split_head_plan`; every task takes the
    stage cost model's time, so a shard's backward includes the recomputation of its logits
    (`head_split.split_head_costs`)."""
    from .ring_fill import simulated_makespan
    from .stage_cost_model import StageCostModel

    split, planned = split_head_plan(num_devices, num_microbatches, costs, asynchronous, backward_ratio,
                                     max_head_shards, iterations)
    runs = iterations if asynchronous else 1
    makespan = simulated_makespan(planned.partition, StageCostModel(split.costs, planned.settings), runs)
    busy = runs * (sum(planned.forward_stage_s) + sum(planned.backward_stage_s))
    return 1.0 - busy / (num_devices * makespan)


def compare_bubbles(num_devices: int, num_microbatches: int, costs: Sequence[float], chunks: int = 2,
                    split_head: bool = False) -> dict[str, float | NotBuilt]:
    """Bubble ratios, in [0, 1], of every schedule for one cost profile; a classic schedule that cannot be built for
    these counts is a `NotBuilt` saying why (RoundPipe's two are always numbers). With `split_head` the last layer
    (the LM head) is cut into vocabulary shards: RoundPipe's planner picks their number and the stage counts
    (`split_head_plan`), and the classic schedules get the head in as many shards as RoundPipe's sync plan (their
    backward at `backward_ratio` like every layer's; RoundPipe's shards also recompute their logits)."""
    if split_head:
        shards = split_head_plan(num_devices, num_microbatches, costs, asynchronous=False)[0].num_head_shards
        classic_costs = list(costs[:-1]) + [costs[-1] / shards] * shards
        sync = roundpipe_split_head_bubble(num_devices, num_microbatches, costs, asynchronous=False)
        lagged = roundpipe_split_head_bubble(num_devices, num_microbatches, costs, asynchronous=True)
    else:
        classic_costs = costs
        sync = roundpipe_bubble(num_devices, num_microbatches, costs, asynchronous=False)
        lagged = roundpipe_bubble(num_devices, num_microbatches, costs, asynchronous=True)
    c = classic_costs

    def classic(build) -> float | NotBuilt:
        try:
            schedule = build()
        except ScheduleNotBuilt as e:
            return NotBuilt(e.reason)
        return simulate_classic(schedule, c)

    return {
        "gpipe": classic(lambda: gpipe(num_devices, num_microbatches, c)),
        "1f1b": classic(lambda: one_f_one_b(num_devices, num_microbatches, c)),
        "interleaved_1f1b": classic(lambda: interleaved_one_f_one_b(num_devices, num_microbatches, c, chunks)),
        "looped_bfs": classic(lambda: looped_bfs(num_devices, num_microbatches, c, chunks)),
        "roundpipe_sync": sync,
        "roundpipe_async": lagged,
    }
