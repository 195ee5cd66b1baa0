"""The plan as data: partitions, the round-robin schedule, its validator and its simulation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from accelerate_roundpipe import RoundPipe, RoundPipeConfig
from accelerate_roundpipe.plan import (
    Mode,
    ScheduleError,
    Span,
    Task,
    TaskKind,
    build_schedule,
    format_schedule,
    plan_partition,
    simulate,
    validate_schedule,
)
from accelerate_roundpipe.plan.schedule import round_spans

ASSETS = Path(__file__).parent / "assets"


def test_default_partition_is_asymmetric():
    p = plan_partition(13)
    assert p.forward == (Span(0, 3), Span(3, 6), Span(6, 9), Span(9, 12))  # 3 layers per forward stage
    assert p.fused == Span(12, 13)
    assert all(len(s) == 1 for s in p.backward)  # 1 layer per backward stage (3x the cost each)
    assert p.saved_input_layers("stage") == frozenset(range(12))
    assert p.saved_input_layers("layer") == frozenset(range(12))


def test_partition_follows_costs_and_fills_the_fused_stage_first():
    # A heavy head sets the slot budget: backward stages pack 3 decoder layers, forward stages 9.
    forward = [1.0] * 12 + [3.0]
    p = plan_partition(13, forward_costs=forward)
    assert p.fused == Span(12, 13)
    assert [len(s) for s in p.backward] == [3, 3, 3, 3, 1]
    assert [len(s) for s in p.forward] == [9, 3]
    # The budget packs the top backward stage first: leftovers land at the bottom.
    q = plan_partition(7, max_stage_cost=6.0)
    assert [len(s) for s in q.backward] == [1, 2, 2, 2]


def test_explicit_partition_and_its_errors():
    p = plan_partition(9, forward_stages=[4, 1], backward_stages=[2, 3, 4])
    assert p.forward == (Span(0, 4), Span(4, 5)) and p.fused == Span(5, 9)
    with pytest.raises(ValueError, match="backward_stages .* sum to 8 layers; the model has 9"):
        plan_partition(9, backward_stages=[4, 4])
    with pytest.raises(ValueError, match="forward_stages .* below the fused stage are 5"):
        plan_partition(9, forward_stages=[4], backward_stages=[2, 3, 4])


def test_figure1_schedule_golden():
    """12 layers + LM head on 4 devices (the paper's Figure 1 case)."""
    partition = plan_partition(13)
    tasks = build_schedule(partition, num_microbatches=8, microbatches_per_round=4, num_devices=4)
    validate_schedule(tasks, 13, 8, 4)
    expected = (ASSETS / "figure1_schedule.txt").read_text().splitlines()
    grid = [line for line in expected if not line.startswith("#")]
    assert format_schedule(tasks, 4).splitlines() == grid
    assert len(tasks) == 2 * (4 + 1 + 12)  # rounds x (S_f + fused + S_b - 1)
    assert [t.kind for t in tasks[:6]] == [TaskKind.FORWARD] * 4 + [TaskKind.FUSED, TaskKind.BACKWARD]
    assert [t.device_index for t in tasks] == [k % 4 for k in range(len(tasks))]
    assert all(Task.from_str(str(t)) == t for t in tasks)
    # The second iteration starts where the first stopped: nothing is reset.
    nxt = build_schedule(partition, 8, 4, 4, start_device=len(tasks) % 4)
    assert nxt[0].device_index == 2 and str(nxt[0]) == "F0:L0-2:r0:m0-3@d2"


@pytest.mark.parametrize("num_devices", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("num_layers", [5, 13, 30])
def test_unit_cost_run_idles_exactly_n_times_n_minus_1(num_devices, num_layers):
    partition = plan_partition(num_layers)
    for rounds in (1, 2, 3):
        num_mb = rounds * num_devices
        tasks = build_schedule(partition, num_mb, num_devices, num_devices, start_device=1)
        result = simulate(tasks, num_devices)
        stages = len(partition.forward) + len(partition.backward)
        assert result.total_idle == num_devices * (num_devices - 1)
        assert result.makespan == (num_mb * stages + num_devices * (num_devices - 1)) / num_devices
        assert result.bubble_ratio == pytest.approx(
            num_devices * (num_devices - 1) / (num_mb * stages + num_devices * (num_devices - 1)))


def test_forward_and_backward_modes():
    partition = plan_partition(6, backward_stages=[2, 2, 2])
    fwd = build_schedule(partition, 4, 2, 2, mode=Mode.FORWARD)
    assert all(t.kind is TaskKind.FORWARD for t in fwd)
    validate_schedule(fwd, 6, 4, 2, mode=Mode.FORWARD)
    bwd = build_schedule(partition, 4, 2, 2, mode=Mode.BACKWARD)
    assert [str(t.span) for t in bwd[:3]] == ["L4-5", "L2-3", "L0-1"]
    validate_schedule(bwd, 6, 4, 2, mode=Mode.BACKWARD)


def test_validator_marks_the_failing_row():
    tasks = build_schedule(plan_partition(4), 2, 2, 2)
    broken = tasks[:1] + tasks[2:3] + tasks[1:2] + tasks[3:]
    with pytest.raises(ScheduleError, match=r"round 0, device \d: task .* (breaks|before)") as info:
        validate_schedule(broken, 4, 2, 2)
    assert "<-- ERROR HERE" in str(info.value)
    with pytest.raises(ValueError, match="not a task string"):
        Task.from_str("X1:L0-1")


def test_rounds_cover_uneven_counts():
    assert round_spans(7, 3) == [Span(0, 3), Span(3, 6), Span(6, 7)]


def test_engine_rolls_the_start_device_across_iterations():
    torch.manual_seed(0)
    engine = RoundPipe(nn.Sequential(*[nn.Linear(4, 4) for _ in range(5)]),
                       RoundPipeConfig(devices=["cpu"] * 3, num_microbatches=3))
    first = engine.schedule(3)
    assert first[0].device_index == 0
    engine.forward_backward(torch.randn(3, 4), labels=torch.randn(3, 4), loss_fn=nn.functional.mse_loss)
    second = engine.schedule(3)
    assert second[0].device_index == len(first) % 3
    engine.close()
