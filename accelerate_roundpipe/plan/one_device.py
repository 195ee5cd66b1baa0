"""The plan for a single device: no recomputation where the memory budget allows it.

On one device nothing runs in parallel: an iteration takes the sum of its stages, so the min-max objective of
`planner.py` (which paces a ring of devices) does not apply, and recomputation is pure extra work (a third more
FLOPs). The fused stage, which runs forward and backward without recomputing, takes as many top layers as fit the
memory budget (on a large GPU: the whole model, i.e. training as in-GPU without checkpointing, with the weights
streamed from the host); the layers below are recomputed in backward stages as large as fit (fewer tasks and fewer
saved inputs), after forward stages as large as fit. Memory per stage is `StageCostModel.memory`.
"""

from __future__ import annotations

import time

from .layer_costs import LayerCosts
from .partition import Partition, Span
from .planned_partition import PlannedPartition
from .schedule import TaskKind
from .stage_cost_model import PlanSettings, StageCostModel, check_every_layer_fits


def _pack_down(model: StageCostModel, kind: TaskKind, stop: int) -> list[Span]:
    """Layers [0, stop) in stages as large as fit the budget, filled from the top."""
    spans = []
    while stop > 0:
        start = stop - 1
        while start > 0 and model.memory(kind, start - 1, stop) <= model.budget:
            start -= 1
        spans.append(Span(start, stop))
        stop = start
    return spans[::-1]


def plan_one_device(costs: LayerCosts, settings: PlanSettings) -> PlannedPartition:
    """The largest fused stage that fits `settings.gpu_memory_bytes`, the layers below it in stages as large as fit.
    Raises ValueError naming the layer that cannot fit alone."""
    started = time.perf_counter()
    model = StageCostModel(costs, settings)
    check_every_layer_fits(model)
    top = costs.num_layers
    fused_start = top - 1
    while fused_start > 0 and model.memory(TaskKind.FUSED, fused_start - 1, top) <= model.budget:
        fused_start -= 1
    backward = _pack_down(model, TaskKind.BACKWARD, fused_start) + [Span(fused_start, top)]
    forward = _pack_down(model, TaskKind.FORWARD, fused_start)
    partition = Partition(num_layers=top, forward=tuple(forward), backward=tuple(backward))
    return PlannedPartition.predict(partition, model, time.perf_counter() - started)
