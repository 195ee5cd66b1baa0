"""Stage counts that fill the ring: the forward and backward stage counts whose simulated iteration is shortest.

[Note: filling the ring]
The planner minimises the slowest stage, which sets the pace of the ring, but an iteration's length also depends on
how its S tasks fall onto the N devices and on the stages below the slowest. One iteration takes about ceil(S / N)
waves of tasks plus the warm-up (with S = 45 on 8 devices the last wave runs on 5 devices while 3 idle), and in the
steady state of lagged steps a stage much cheaper than the one before it leaves its device waiting for that one's
micro-batches (Llama-3.1-8B, head in 3 shards, 8 devices: 4.6% bubble as planned, 1.7% with other stage counts).
`fill_ring` therefore tries every forward and backward stage count from N - 1 below to N - 1 above the planner's
(never fewer than fit the memory budget, nor fewer backward stages than devices), each side balanced by the
planner's own parametric search (`planner._balanced`), replays each with the stage cost model's times, and keeps
the shortest run (ties: fewer stages): one iteration for the exact step, several back to back for the lagged one.
It needs O(N^2) replays, about a millisecond each.
"""

from __future__ import annotations

import sys
import time

from .layer_costs import LayerCosts
from .partition import Partition
from .planned_partition import PlannedPartition
from .planner import _balanced, _greedy
from .schedule import Mode, TaskKind, stage_sequence
from .stage_cost_model import PlanSettings, StageCostModel

F, FB, B = TaskKind.FORWARD, TaskKind.FUSED, TaskKind.BACKWARD
# A time bound every stage that fits memory meets; `time_if_fits` gives inf (above it) to those that do not.
_ANY_TIME = sys.float_info.max


def simulated_makespan(partition: Partition, model: StageCostModel, iterations: int = 1) -> float:
    """Time of `iterations` iterations of one round each, back to back (1: one iteration with its warm-up and
    cool-down; more: the lagged step's steady state), every task taking the stage cost model's time. The same replay
    as `simulate.simulate` over `build_schedule`'s tasks (a test checks it), without building the tasks: the planner
    runs it for every candidate."""
    settings = model.settings
    m, n = settings.num_microbatches, settings.num_devices
    per_microbatch = [model.time(kind, *span) / m for kind, _, span in stage_sequence(partition, Mode.TRAIN)]
    device_free = [0.0] * n
    slot = 0
    for _ in range(iterations):
        ready = [0.0] * m  # when micro-batch mb left the previous task of this iteration
        for duration in per_microbatch:
            device = slot % n
            slot += 1
            clock = device_free[device]
            for mb in range(m):
                if ready[mb] > clock:
                    clock = ready[mb]
                clock += duration
                ready[mb] = clock
            device_free[device] = clock
    return max(device_free)


def fill_ring(planned: PlannedPartition, costs: LayerCosts, iterations: int = 1) -> PlannedPartition:
    """`planned`'s fused stage with the forward and backward stage counts whose simulated run of `iterations`
    iterations is shortest ([Note: filling the ring]); `planned` itself when nothing is shorter."""
    started = time.perf_counter()
    settings: PlanSettings = planned.settings
    model = StageCostModel(costs, settings)
    p = planned.partition
    fused, top = p.fused, p.fused.start
    best_key = (simulated_makespan(p, model, iterations), len(p.forward) + len(p.backward))
    best = p
    if top:
        n = settings.num_devices
        need_backward = min(n, costs.num_layers) - 1
        fewest_f = max(len(_greedy(model, F, 0, top, _ANY_TIME, from_top=False)[0]), len(p.forward) - n + 1)
        fewest_b = max(need_backward, len(_greedy(model, B, 0, top, _ANY_TIME, from_top=True)[0]),
                       len(p.backward) - n)
        backwards = [tuple(_balanced(model, B, 0, top, num_b, _ANY_TIME, from_top=True))
                     for num_b in range(fewest_b, min(top, len(p.backward) - 1 + n - 1) + 1)]
        for num_f in range(fewest_f, min(top, len(p.forward) + n - 1) + 1):
            forward = tuple(_balanced(model, F, 0, top, num_f, _ANY_TIME, from_top=False))
            for backward in backwards:
                num_b = len(backward)
                candidate = Partition(num_layers=p.num_layers, forward=forward, backward=backward + (fused,))
                key = (simulated_makespan(candidate, model, iterations), num_f + num_b + 1)
                if _shorter(key, best_key):
                    best_key, best = key, candidate
    return PlannedPartition.predict(best, model, planned.search_s + time.perf_counter() - started)


# Makespans this close are equal (sums of the same costs in other orders): the one with fewer stages wins, whatever
# the unit the costs are given in.
_RELATIVE_TIE = 1e-9


def _shorter(key: tuple[float, int], best: tuple[float, int]) -> bool:
    (time_s, stages), (best_s, best_stages) = key, best
    if abs(time_s - best_s) <= _RELATIVE_TIE * max(abs(best_s), abs(time_s)):
        return stages < best_stages
    return time_s < best_s
