"""[Note: limits in allocated bytes]: a pass's saved-input and look-ahead limits are compared with the device's
allocated memory, which holds the optimizer state placed there; the planner's rooms are beside that state. So each
pass plan carries its room plus the placed state. Before, with the state on the device, the limits counted the
state twice (the planner's budget had it subtracted, the allocated memory had it in), and a 4B under a 24 GiB cap
could never keep a saved input or take a look-ahead."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from accelerate_roundpipe import RoundPipe, RoundPipeConfig
from accelerate_roundpipe.runtime.engine import pass_launch
from accelerate_roundpipe.runtime.execution import measured_plan

from toy_models import batch, tied_model


def _plans_of_three_steps(monkeypatch, placement: str) -> tuple[RoundPipe, list]:
    """The engine after three training steps (from the second on re-planned) and every pass plan it made."""
    made = []
    original = pass_launch.PassPlan

    def recorded(*args, **kwargs):
        made.append(original(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(pass_launch, "PassPlan", recorded)
    engine = RoundPipe(tied_model(), RoundPipeConfig(devices=["cpu"], plan="measured", gpu_memory_budget=8,
                                                     optimizer_placement=placement, summary=False))
    optimizer = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-2))
    for k in range(3):
        x, mask, y = batch(rows=8, seed=k)
        engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy)
        optimizer.step()
        optimizer.zero_grad()
    return engine, made


@pytest.mark.parametrize("placement", ["device", "host"])
def test_a_pass_plan_carries_the_planned_rooms_plus_the_state_on_the_device(monkeypatch, placement):
    engine, made = _plans_of_three_steps(monkeypatch, placement)
    try:
        plan = engine._launch.plan
        state = engine.optimizer_placement.most_on_one_device()
        assert (state > 0) == (placement == "device")
        assert plan.device_state_bytes == state
        assert plan.keep_limit_bytes > 0 and plan.lookahead_limit_bytes > 0  # re-planned with room to spare
        last = made[-1]
        assert last.keep_limit_bytes == plan.keep_limit_bytes + state
        assert last.lookahead_limit_bytes == plan.lookahead_limit_bytes + state
        assert made[0].lookahead_limit_bytes == 0  # the measured pass: no plan yet, never
    finally:
        engine.close()


def test_without_the_switch_the_limits_are_the_rooms(monkeypatch):
    monkeypatch.setattr(measured_plan, "COUNT_PLACED_STATE", False)
    engine, made = _plans_of_three_steps(monkeypatch, "device")
    try:
        plan = engine._launch.plan
        assert plan.device_state_bytes > 0
        assert made[-1].keep_limit_bytes == plan.keep_limit_bytes
        assert made[-1].lookahead_limit_bytes == plan.lookahead_limit_bytes
    finally:
        engine.close()


def test_a_zero_room_stays_never():
    plan = measured_plan.MeasuredPlan.__new__(measured_plan.MeasuredPlan)
    plan.device_state_bytes = 5 << 30
    assert plan.allocated_limit(0) == 0
    assert plan.allocated_limit(1 << 30) == 6 << 30
