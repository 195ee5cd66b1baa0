"""The one-device plan: the fused stage (no recomputation) takes as many top layers as the memory budget allows."""

from __future__ import annotations

import random

import pytest

from accelerate_roundpipe.plan.layer_costs import LayerCosts
from accelerate_roundpipe.plan.one_device import plan_one_device
from accelerate_roundpipe.plan.schedule import TaskKind
from accelerate_roundpipe.plan.stage_cost_model import PlanSettings, StageCostModel


def costs(num_layers: int, seed: int) -> LayerCosts:
    rng = random.Random(seed)
    return LayerCosts(forward_s=[rng.uniform(1, 3) for _ in range(num_layers)],
                      backward_s=[rng.uniform(2, 6) for _ in range(num_layers)],
                      param_bytes=[rng.randint(10, 40) for _ in range(num_layers)],
                      grad_bytes=[rng.randint(10, 40) for _ in range(num_layers)],
                      act_bytes=[rng.randint(20, 80) for _ in range(num_layers)],
                      input_bytes=[4] * num_layers)


def settings(budget: float) -> PlanSettings:
    return PlanSettings(num_devices=1, num_microbatches=2, gpu_memory_bytes=budget, pcie_bytes_per_s=1.0)


@pytest.mark.parametrize("seed", range(20))
def test_fused_stage_is_the_largest_that_fits_and_every_stage_fits(seed):
    layer_costs = costs(12, seed)
    for budget in (400, 700, 1500, 10**6):
        try:
            partition = plan_one_device(layer_costs, settings(budget)).partition
        except ValueError as error:
            assert "alone needs" in str(error)
            continue
        model = StageCostModel(layer_costs, settings(budget))
        fused = partition.fused
        assert model.memory(TaskKind.FUSED, *fused) <= budget
        if fused.start > 0:  # one more layer would not fit
            assert model.memory(TaskKind.FUSED, fused.start - 1, 12) > budget
        for span in partition.backward[:-1]:
            assert model.memory(TaskKind.BACKWARD, *span) <= budget
        for span in partition.forward:
            assert model.memory(TaskKind.FORWARD, *span) <= budget
        if budget == 10**6:  # room for everything: no recomputation at all
            assert partition.forward == () and fused.start == 0


def test_more_memory_never_recomputes_more():
    layer_costs = costs(16, 7)
    starts = [plan_one_device(layer_costs, settings(b)).partition.fused.start for b in (800, 1200, 2000, 4000, 10**6)]
    assert starts == sorted(starts, reverse=True) and starts[-1] == 0
