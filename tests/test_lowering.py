"""The schedule lowered into actions with their inputs: the string form, the validator, the replay, the CLI."""

from __future__ import annotations

import pytest

from accelerate_roundpipe.plan import (
    Action,
    ActionError,
    ActionKind,
    Mode,
    Span,
    Task,
    TaskKind,
    build_schedule,
    format_actions,
    lower_schedule,
    plan_partition,
    replay_actions,
    simulate,
    task_links,
    validate_actions,
)
from accelerate_roundpipe.plan.simulate_cli import main as simulate_main

# 2 layers on 2 devices: F0 over layer 0, the fused stage over layer 1, B0 over layer 0.
SMALL = plan_partition(2)


def lines(actions: list[Action]) -> list[str]:
    return [str(a) for a in actions]


def test_one_round_lowered():
    tasks = build_schedule(SMALL, 2, 2, 2)
    assert lines(lower_schedule(tasks)) == [
        "0:UPLOAD t0 F0:L0-0:r0:m0-1@d0",
        "1:COMPUTE t0 F0:L0-0:r0:m0-1@d0 <0",
        "2:SEND t0 F0:L0-0:r0:m0-1@d0 >d1 <1",
        "3:UPLOAD t1 FB1:L1-1:r0:m0-1@d1",
        "4:COMPUTE t1 FB1:L1-1:r0:m0-1@d1 <2,3",
        "5:SEND t1 FB1:L1-1:r0:m0-1@d1 >d0 <4",
        "6:COMMIT t1 FB1:L1-1:r0:m0-1@d1 <4",
        "7:STEP t1 FB1:L1-1:r0:m0-1@d1 <6",
        "8:UPLOAD t2 B0:L0-0:r0:m0-1@d0",
        "9:COMPUTE t2 B0:L0-0:r0:m0-1@d0 <5,8",
        "10:SEND t2 B0:L0-0:r0:m0-1@d0 >caller <9",
        "11:COMMIT t2 B0:L0-0:r0:m0-1@d0 <9",
        "12:STEP t2 B0:L0-0:r0:m0-1@d0 <11",
    ]


def test_two_rounds_step_after_the_last_commit_of_their_layers():
    """Each round is a chain of its own; a stage's STEP waits for its commits of every round."""
    tasks = build_schedule(SMALL, 4, 2, 2)
    actions = lower_schedule(tasks)
    assert lines(actions)[11:] == [
        "11:UPLOAD t3 F0:L0-0:r1:m2-3@d1",
        "12:COMPUTE t3 F0:L0-0:r1:m2-3@d1 <11",  # the round's first task: its input is the caller's
        "13:SEND t3 F0:L0-0:r1:m2-3@d1 >d0 <12",
        "14:UPLOAD t4 FB1:L1-1:r1:m2-3@d0",
        "15:COMPUTE t4 FB1:L1-1:r1:m2-3@d0 <13,14",
        "16:SEND t4 FB1:L1-1:r1:m2-3@d0 >d1 <15",
        "17:COMMIT t4 FB1:L1-1:r1:m2-3@d0 <15",
        "18:STEP t4 FB1:L1-1:r1:m2-3@d0 <6,17",
        "19:UPLOAD t5 B0:L0-0:r1:m2-3@d1",
        "20:COMPUTE t5 B0:L0-0:r1:m2-3@d1 <16,19",
        "21:SEND t5 B0:L0-0:r1:m2-3@d1 >caller <20",
        "22:COMMIT t5 B0:L0-0:r1:m2-3@d1 <20",
        "23:STEP t5 B0:L0-0:r1:m2-3@d1 <10,22",
    ]
    assert [a.kind for a in actions[:11]].count(ActionKind.STEP) == 0
    validate_actions(actions)


def test_forward_and_backward_passes_lowered():
    partition = plan_partition(4, backward_stages=[2, 2])
    forward = lower_schedule(build_schedule(partition, 1, 1, 1, mode=Mode.FORWARD))
    assert lines(forward) == [
        "0:UPLOAD t0 F0:L0-1:r0:m0-0@d0",
        "1:COMPUTE t0 F0:L0-1:r0:m0-0@d0 <0",
        "2:SEND t0 F0:L0-1:r0:m0-0@d0 >d0 <1",  # the next task runs on the same device
        "3:UPLOAD t1 F1:L2-3:r0:m0-0@d0",
        "4:COMPUTE t1 F1:L2-3:r0:m0-0@d0 <2,3",
        "5:SEND t1 F1:L2-3:r0:m0-0@d0 >caller <4",
    ]
    backward = lower_schedule(build_schedule(partition, 1, 1, 2, mode=Mode.BACKWARD))
    assert lines(backward)[:3] == [
        "0:UPLOAD t0 B1:L2-3:r0:m0-0@d0",
        "1:COMPUTE t0 B1:L2-3:r0:m0-0@d0 <0",  # the gradient of the pass's outputs comes from the caller
        "2:SEND t0 B1:L2-3:r0:m0-0@d0 >d1 <1",
    ]
    validate_actions(forward)
    validate_actions(backward)


@pytest.mark.parametrize("mode", list(Mode))
@pytest.mark.parametrize("num_devices,num_mb,per_round", [(1, 1, 1), (2, 4, 2), (3, 7, 3), (4, 8, 4), (8, 16, 16)])
def test_every_built_schedule_lowers_to_valid_actions_that_round_trip(mode, num_devices, num_mb, per_round):
    for partition in (plan_partition(13), plan_partition(5), plan_partition(9, backward_stages=[2, 3, 4])):
        tasks = build_schedule(partition, num_mb, per_round, num_devices, start_device=num_devices - 1, mode=mode)
        actions = lower_schedule(tasks)
        validate_actions(actions)
        assert [Action.from_str(str(a)) for a in actions] == actions
        printed = format_actions(actions).splitlines()
        assert [Action.from_str(line) for line in printed[2:]] == actions
        computes = [a for a in actions if a.kind is ActionKind.COMPUTE]
        assert [a.task_index for a in computes] == list(range(len(tasks)))


def test_links_name_each_tasks_source_and_receiver():
    tasks = build_schedule(SMALL, 4, 2, 2)
    links = task_links(lower_schedule(tasks))
    assert [link.source for link in links] == [None, 0, 1, None, 3, 4]
    assert [link.send_to for link in links] == [1, 0, None, 0, 1, None]


def test_from_str_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="not an action string"):
        Action.from_str("3:SEND t1 F0:L0-0")


def broken(actions: list[Action], index: int, **fields) -> list[Action]:
    return actions[:index] + [actions[index]._replace(**fields)] + actions[index + 1:]


def test_validator_marks_the_failing_action():
    actions = lower_schedule(build_schedule(SMALL, 2, 2, 2))
    cases = [
        (broken(actions, 4, deps=(3, 99)), 4, "depends on action 99, which does not exist"),
        (broken(actions, 4, deps=(3, 5)), 4, "depends on action 5, which comes after it"),
        (broken(actions, 4, deps=(3,)), 4, "no SEND feeds it"),
        (broken(actions, 9, deps=(2, 8)), 9, "is fed by SEND 2"),
        (broken(actions, 2, to_device=0), 2, "sends to d0 but action 4 runs on d1"),
        (broken(actions, 6, deps=(1,)), 6, "commits the gradients of action 1"),
        (broken(actions, 12, deps=()), 12, "steps layers \\[0\\] before their commit 11"),
        (broken(actions, 3, id=4), 3, "has id 4 at position 3"),
        (actions[:12], 11, "layers \\[0\\] are committed but never stepped"),
        (actions[:11], 9, "backward COMPUTE has no COMMIT"),
    ]
    for bad, index, message in cases:
        with pytest.raises(ActionError, match=message) as info:
            validate_actions(bad)
        marked = [line for line in str(info.value).splitlines() if line.endswith("<-- ERROR HERE")]
        assert marked == [f"{format_actions(bad).splitlines()[2 + index]}  <-- ERROR HERE"], (message, str(info.value))


def test_validator_refuses_a_flow_out_of_order():
    """Hand-made task lists lowered as they are: the validator sees what `validate_schedule` would refuse."""
    f0, fb1, b0 = build_schedule(SMALL, 2, 2, 1)
    top_first = Task(TaskKind.BACKWARD, 1, Span(1, 2), 0, Span(0, 2), 0)
    with pytest.raises(ActionError, match="backward of layers \\[1\\] before their forward"):
        validate_actions(lower_schedule([f0, top_first]))
    with pytest.raises(ActionError, match="forward of layers \\[0\\] after its backward started"):
        validate_actions(lower_schedule([f0, fb1, b0, f0]))
    with pytest.raises(ActionError, match="forward of layers \\[1\\] before the forward of layers below 1"):
        validate_actions(lower_schedule([fb1, b0]))
    with pytest.raises(ActionError, match="backward of layers \\[0\\] before the backward of layers above 0"):
        validate_actions(lower_schedule([f0, fb1._replace(kind=TaskKind.FORWARD), b0]))


def test_replay_follows_the_dependencies_it_is_given():
    """The simulator replays the actions: an extra input (round 1's forward waiting for round 0's backward, a
    dependency on other micro-batches, so on the whole action) makes the run as long as two rounds back to back."""
    tasks = build_schedule(SMALL, 4, 2, 2)
    actions = lower_schedule(tasks)
    assert replay_actions(actions, 2) == simulate(tasks, 2)
    assert simulate(tasks, 2).makespan == 7.0
    serial = broken(actions, 12, deps=(9, 11))  # COMPUTE of round 1's F0 after SEND 9 (round 0's B0 to the caller)
    assert replay_actions(serial, 2).makespan == 8.0


def test_cli_prints_the_lowered_actions(capsys):
    simulate_main(["--model", "qwen3-1.7b", "--devices", "8", "--microbatches", "16", "--actions"])
    out = capsys.readouterr().out
    start = out.index("lowered sync iteration")
    printed = out[start:].splitlines()[3:]
    actions = [Action.from_str(line) for line in printed if line.strip()]
    validate_actions(actions)
    assert sum(a.kind is ActionKind.COMPUTE for a in actions) > 8


def test_dispatch_takes_each_tasks_input_and_receiver_from_the_lowering(monkeypatch):
    """The engine's jobs are wired as the lowered schedule says: inputs are the outputs of the task its COMPUTE
    waits for, the receiver is its SEND's, and the pass's outputs are those of the SENDs to the caller."""
    import torch
    from torch import nn

    from accelerate_roundpipe import RoundPipe, RoundPipeConfig
    from accelerate_roundpipe.runtime.execution.dispatch import Dispatcher
    from accelerate_roundpipe.runtime.execution.jobs import PassResults

    enqueued, expected_outputs = [], {}
    original, original_expect = Dispatcher.enqueue, PassResults.expect_outputs

    def recording(self, tasks, plan, results, first_inputs):
        jobs = original(self, tasks, plan, results, first_inputs)
        enqueued.append((tasks, results, jobs))
        return jobs

    def recording_expect(self, outputs):
        expected_outputs[id(self)] = list(outputs)
        original_expect(self, outputs)

    monkeypatch.setattr(Dispatcher, "enqueue", recording)
    monkeypatch.setattr(PassResults, "expect_outputs", recording_expect)
    torch.manual_seed(0)
    engine = RoundPipe(nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)]),
                       RoundPipeConfig(devices=["cpu"] * 3, num_microbatches=4, microbatches_per_round=2))
    try:
        engine.forward_backward(torch.randn(4, 4), labels=torch.randn(4, 4), loss_fn=nn.functional.mse_loss)
        with torch.no_grad():  # a forward pass: the caller takes its outputs
            engine(torch.randn(4, 4))
        engine.synchronize()
    finally:
        engine.close()
    (train_tasks, _, train_jobs), (tasks, results, jobs) = enqueued
    for tasks_, jobs_ in ((train_tasks, train_jobs), (tasks, jobs)):
        links = task_links(lower_schedule(tasks_))
        assert len({t.round_index for t in tasks_}) == 2
        for job, link in zip(jobs_, links, strict=True):
            assert job.next_worker == link.send_to
            if link.source is not None:
                assert job.inputs is jobs_[link.source].outputs
    last = [job for job, link in zip(jobs, task_links(lower_schedule(tasks))) if link.send_to is None]
    assert [f for job in last for f in job.outputs] == expected_outputs[id(results)]
