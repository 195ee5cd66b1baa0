"""The one-device plan: the fused stage (no recomputation) takes as many top layers as the memory budget allows."""

from __future__ import annotations

import random

import pytest

from accelerate_roundpipe.plan.layer_costs import LayerCosts
from accelerate_roundpipe.plan.microbatch_choice import (
    MIN_PREDICTED_GAIN,
    choose_one_device_plan,
    costs_for_count,
    predicted_iteration_s,
)
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


# ---------------------------------------------------------------- the micro-batch count ([Note: one-device
# micro-batch count])

def settings_for(budget: float):
    return lambda count: PlanSettings(num_devices=1, num_microbatches=count, gpu_memory_bytes=budget,
                                      pcie_bytes_per_s=1e9)


def test_costs_for_count_scale_what_a_micro_batch_holds_but_not_the_weights():
    base = costs(4, 0)
    half = costs_for_count(base, measured_count=2, count=4)
    assert half.forward_s == pytest.approx([t / 2 for t in base.forward_s])
    assert half.recompute_s == pytest.approx([t / 2 for t in base.forward_s])  # the default: forward_s
    assert half.act_bytes == pytest.approx([a / 2 for a in base.act_bytes])
    assert half.param_bytes == base.param_bytes and half.grad_bytes == base.grad_bytes


def test_the_fewest_micro_batches_that_fit_the_whole_model_win():
    planned, count = choose_one_device_plan(costs(12, 3), measured_count=4, rows=8, settings_for=settings_for(1e9))
    assert count == 1 and planned.partition.forward == ()


@pytest.mark.parametrize("seed", range(10))
def test_without_room_for_the_whole_model_the_fastest_predicted_count_wins(seed):
    layer_costs = costs(12, seed)
    for budget in (600, 900, 1400):
        plans = {}
        for count in (1, 2, 4, 8):
            try:
                plans[count] = plan_one_device(costs_for_count(layer_costs, 2, count), settings_for(budget)(count))
            except ValueError:
                pass
        if not plans or any(p.partition.forward == () for p in plans.values()):
            continue
        planned, count = choose_one_device_plan(layer_costs, measured_count=2, rows=8,
                                                settings_for=settings_for(budget))
        times = {c: predicted_iteration_s(p, c) for c, p in plans.items()}
        if count != 2:  # switched: the fastest, and by more than the threshold
            assert times[count] == min(times.values())
            assert 2 not in times or times[count] <= times[2] * (1 - MIN_PREDICTED_GAIN)
        else:
            assert min(times.values()) > times[2] * (1 - MIN_PREDICTED_GAIN)
        assert planned.partition == plans[count].partition


def test_more_micro_batches_win_when_they_let_more_layers_skip_recomputation():
    # Activations dominate: halving the micro-batch lets the fused stage hold twice the layers.
    layer_costs = LayerCosts(forward_s=[1.0] * 8, backward_s=[2.0] * 8, param_bytes=[1] * 8, grad_bytes=[0] * 8,
                             act_bytes=[100] * 8, input_bytes=[1] * 8, work_bytes=[0] * 8)
    budget = 2 * 8 + 250  # at the measured size two layers' activations fit, at half the size four
    measured = plan_one_device(layer_costs, settings_for(budget)(2))
    planned, count = choose_one_device_plan(layer_costs, measured_count=2, rows=8, settings_for=settings_for(budget))
    assert count > 2 and planned.partition.fused.start < measured.partition.fused.start
    assert predicted_iteration_s(planned, count) < predicted_iteration_s(measured, 2)
