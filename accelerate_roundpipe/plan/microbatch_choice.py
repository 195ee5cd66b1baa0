"""How many micro-batches one device runs, chosen from the measured layer costs of one pass.

[Note: one-device micro-batch count]
On one device, larger micro-batches keep the GPU busier per kernel and per Python call (an H200 ran Qwen3-1.7B 11%
faster with 1 micro-batch than with 2), so the fewest micro-batches for which the whole model fits the fused stage
(no recomputation) win. When no count fits the whole model, the count decides how many top layers the fused stage
holds: smaller micro-batches hold fewer activations each, so more layers skip their recomputation. Under a 24 GiB
cap Llama-3.1-8B LoRA ran 3.9% faster with 4 micro-batches than with the 2 it was measured with (10,282 against
9,900 tok/s on an H200), with more layers fused. So then the count with the shortest predicted iteration (the sum of
its stages' predicted times, over every round) is taken, but only when it beats the measured count's by
`MIN_PREDICTED_GAIN`: the cost model does not see the per-kernel efficiency smaller micro-batches lose.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable

from .layer_costs import LayerCosts
from .one_device import plan_one_device
from .planned_partition import PlannedPartition
from .stage_cost_model import PlanSettings

MICROBATCH_CHOICES = (1, 2, 4, 8, 16, 32)
MIN_PREDICTED_GAIN = 0.02  # of the measured count's predicted iteration: below it, keep the measured count


def costs_for_count(costs: LayerCosts, measured_count: int, count: int) -> LayerCosts:
    """`costs` measured with `measured_count` micro-batches, for micro-batches of the size `count` makes: per
    micro-batch times and bytes scale with the rows of a micro-batch; the parameters' do not."""
    scale = measured_count / count

    def scaled(values):
        return None if values is None else [v * scale for v in values]

    return dataclasses.replace(costs, forward_s=scaled(costs.forward_s), backward_s=scaled(costs.backward_s),
                               recompute_s=scaled(costs.recompute_s), act_bytes=scaled(costs.act_bytes),
                               input_bytes=scaled(costs.input_bytes), work_bytes=scaled(costs.work_bytes))


def predicted_iteration_s(planned: PlannedPartition, count: int) -> float:
    """One device runs its stages one after another, once per round of `settings.num_microbatches`."""
    rounds = math.ceil(count / planned.settings.num_microbatches)
    return rounds * (sum(planned.forward_stage_s) + sum(planned.backward_stage_s))


def choose_one_device_plan(costs: LayerCosts, measured_count: int, rows: int,
                           settings_for: Callable[[int], PlanSettings],
                           choices: Iterable[int] = MICROBATCH_CHOICES) -> tuple[PlannedPartition, int]:
    """The plan and micro-batch count for one device ([Note: one-device micro-batch count]). Raises the planner's
    ValueError when no count has a plan that fits."""
    plans: dict[int, PlannedPartition] = {}
    first_error: ValueError | None = None
    for count in sorted({c for c in choices if c <= rows} | {measured_count}):
        try:
            planned = plan_one_device(costs_for_count(costs, measured_count, count), settings_for(count))
        except ValueError as error:
            first_error = first_error if count != measured_count else error
            continue
        if planned.partition.forward == ():  # the whole model in the fused stage: nothing recomputed
            return planned, count
        plans[count] = planned
    if not plans:
        raise first_error
    fastest = min(plans, key=lambda c: (predicted_iteration_s(plans[c], c), c))
    if measured_count in plans and predicted_iteration_s(plans[fastest], fastest) > \
            predicted_iteration_s(plans[measured_count], measured_count) * (1 - MIN_PREDICTED_GAIN):
        return plans[measured_count], measured_count
    return plans[fastest], fastest
