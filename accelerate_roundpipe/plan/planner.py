"""Forward and backward partitions for several devices: the slowest stage as fast as the GPU memory allows.

Stage times and memory are `stage_cost_model.StageCostModel`'s.

Objective: minimise the slowest stage of the round (F, FB and B alike: the devices pass micro-batches around one
ring, so the slowest slot paces it), every stage within the GPU memory budget; then the fewest stages (less per-task
overhead), with at least min(num_devices, layers) backward stages so every device gets work. Forward and backward
are cut independently (the asymmetric split): both are packed up to the same bottleneck, so a forward stage holds
about 3x the layers of a backward stage.

Search. Splitting a stage never makes it slower or bigger, so with the fused stage [f, L) fixed, the best bottleneck
is the slowest single layer below f: T* = min over f of max(FB(f, L), slowest single F below f, slowest single B
below f), an O(L) scan. The fewest stages under T* come from the largest fused stage that stays within T* (fewer
layers below it never need more stages), then a greedy O(L) packing of each side, which gives the fewest stages for
monotone costs. Among partitions with that many stages the planner then balances each side (the smallest slowest
stage for that count): a parametric search over bottleneck values, bisecting between a bound known infeasible and a
bound known feasible. A feasible check lowers the upper bound to the greedy partition's actual slowest stage; an
infeasible check raises the lower bound to the cheapest one-layer extension of one of its stages, the next value at
which the greedy partition can change. The upper bound is always an achieved slowest stage and nothing below the
lower bound is feasible, so when they meet the search has the exact optimum: about a dozen O(L) checks (14 at 94
layers) instead of the paper's O(L^2) candidates times O(L) (1.47 s at 94 layers).
"""

from __future__ import annotations

import math
import time

from .layer_costs import LayerCosts
from .partition import Partition, Span
from .planned_partition import PlannedPartition
from .schedule import TaskKind
from .stage_cost_model import PlanSettings, StageCostModel, check_every_layer_fits

F, FB, B = TaskKind.FORWARD, TaskKind.FUSED, TaskKind.BACKWARD


def _greedy(model: StageCostModel, kind: TaskKind, lo: int, hi: int, bound: float,
            from_top: bool) -> tuple[list[Span], float]:
    """Pack layers [lo, hi) into the fewest stages that fit memory within time `bound` (every single layer must),
    from the top or the bottom. Also returns the smallest time of a stage grown by one layer (inf if none can grow
    within memory): below that bound this packing does not change."""
    spans: list[Span] = []
    next_bound = math.inf
    time_if_fits = model.time_if_fits
    if from_top:
        stop = hi
        while stop > lo:
            start = stop - 1
            while start > lo:
                grown = time_if_fits(kind, start - 1, stop)
                if grown > bound:
                    next_bound = min(next_bound, grown)
                    break
                start -= 1
            spans.append(Span(start, stop))
            stop = start
        spans.reverse()
    else:
        start = lo
        while start < hi:
            stop = start + 1
            while stop < hi:
                grown = time_if_fits(kind, start, stop + 1)
                if grown > bound:
                    next_bound = min(next_bound, grown)
                    break
                stop += 1
            spans.append(Span(start, stop))
            start = stop
    return spans, next_bound


def _split_to(model: StageCostModel, kind: TaskKind, spans: list[Span], parts: int) -> list[Span]:
    """Split the slowest multi-layer stage at its most even point until there are `parts` stages."""
    spans = list(spans)
    while len(spans) < parts:
        index = max((i for i, s in enumerate(spans) if len(s) > 1), key=lambda i: model.time_if_fits(kind, *spans[i]))
        s = spans[index]
        cut = min(range(s.start + 1, s.stop),
                  key=lambda c: max(model.time_if_fits(kind, s.start, c), model.time_if_fits(kind, c, s.stop)))
        spans[index:index + 1] = [Span(s.start, cut), Span(cut, s.stop)]
    return spans


def _balanced(model: StageCostModel, kind: TaskKind, lo: int, hi: int, parts: int, feasible_bound: float,
              from_top: bool) -> list[Span]:
    """The partition of [lo, hi) into exactly `parts` stages whose slowest stage is the smallest (parametric
    search, see the module docstring). `feasible_bound` must admit a packing into at most `parts` stages."""
    best, _ = _greedy(model, kind, lo, hi, feasible_bound, from_top)
    upper = max(model.time_if_fits(kind, *s) for s in best)
    # Infeasible below: no stage is cheaper than its slowest layer, and `parts` stages share the total compute.
    lower = max(max(model.time_if_fits(kind, i, i + 1) for i in range(lo, hi)), model.compute(kind, lo, hi) / parts)
    while lower < upper:
        bound = lower + (upper - lower) / 2
        if bound >= upper:
            bound = lower
        spans, next_bound = _greedy(model, kind, lo, hi, bound, from_top)
        if len(spans) <= parts:
            best, upper = spans, max(model.time_if_fits(kind, *s) for s in spans)
        else:
            lower = next_bound
    return _split_to(model, kind, best, parts)


def plan_from_costs(costs: LayerCosts, settings: PlanSettings) -> PlannedPartition:
    """The partition whose slowest stage is fastest within `settings.gpu_memory_bytes` per stage, then with the fewest
    stages (at least min(num_devices, layers) backward ones), each side balanced. Raises ValueError naming the layer
    that cannot fit alone."""
    started = time.perf_counter()
    num_layers = costs.num_layers
    if num_layers < 1:
        raise ValueError("RoundPipe needs a model with at least one layer.")
    model = StageCostModel(costs, settings)
    check_every_layer_fits(model)

    # Slowest single forward / backward stage among the layers below each possible fused start f.
    below_f = [0.0]
    for layer in range(num_layers - 1):
        below_f.append(max(below_f[-1], model.time(F, layer, layer + 1), model.time(B, layer, layer + 1)))
    # Leaves room below the fused stage for the backward stages every device needs.
    first_fused = min(settings.num_devices, num_layers) - 1
    candidates = range(first_fused, num_layers)
    bottleneck = min(max(model.time_if_fits(FB, f, num_layers), below_f[f]) for f in candidates)
    # The largest fused stage within the bottleneck leaves the fewest layers, hence stages, below it.
    fused_start = next(f for f in candidates if model.time_if_fits(FB, f, num_layers) <= bottleneck)

    forward: list[Span] = []
    backward: list[Span] = []
    if fused_start:
        backward_count = len(_greedy(model, B, 0, fused_start, bottleneck, from_top=True)[0])
        backward = _balanced(model, B, 0, fused_start, max(backward_count, first_fused), bottleneck, from_top=True)
        forward_count = len(_greedy(model, F, 0, fused_start, bottleneck, from_top=False)[0])
        forward = _balanced(model, F, 0, fused_start, forward_count, bottleneck, from_top=False)
    backward.append(Span(fused_start, num_layers))
    partition = Partition(num_layers=num_layers, forward=tuple(forward), backward=tuple(backward))
    return PlannedPartition.predict(partition, model, time.perf_counter() - started)
