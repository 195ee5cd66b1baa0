"""A schedule lowered into actions with their inputs: the one place that says which outputs feed which task.

[Note: schedule lowering]
`lower_schedule` turns a list of `Task`s into `Action`s, a pure list-to-list pass. Per task, in schedule order:
UPLOAD of its layers' buckets (no inputs here: which version of the weights it reads is a matter of tickets, see
[Note: per-layer events]); COMPUTE, after its UPLOAD and the SEND of the previous task of its round (micro-batch m
takes micro-batch m of that task's outputs, so a round is one chain and rounds are independent); SEND of its outputs
to the device of the next task of its round, or to the caller after the round's last; COMMIT of a backward or fused
task's gradients, after its COMPUTE; and STEP once the pass has committed every gradient of a stage's layers (after
that stage's COMMIT in every round). The dispatcher takes each task's input and receiver from the lowered actions
(`task_links`), the simulator replays them (`simulate.replay_actions`) and `action_checks.validate_actions` checks
them, so a new schedule changes `build_schedule` alone. Uploads and commits run where the runtime puts them
(residency, grad_commit); here they are points a replay or a printout can see.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from .actions import Action, ActionKind
from .schedule import Task, TaskKind

BACKWARD_KINDS = (TaskKind.BACKWARD, TaskKind.FUSED)


def lower_schedule(tasks: Sequence[Task]) -> list[Action]:
    """The actions of `tasks`, in order, each with the ids of the actions it waits for ([Note: schedule lowering]).
    Pure: no checks (a trace's task list may begin mid-round); `validate_actions` checks a whole pass."""
    next_in_round: list[int | None] = [None] * len(tasks)
    last_of_round: dict[int, int] = {}
    for index, task in enumerate(tasks):
        before = last_of_round.get(task.round_index)
        if before is not None:
            next_in_round[before] = index
        last_of_round[task.round_index] = index
    last_of_stage = {task.span: index for index, task in enumerate(tasks) if task.kind in BACKWARD_KINDS}

    actions: list[Action] = []
    send_of_round: dict[int, int] = {}  # round -> the id of its latest SEND
    commits_of_stage: dict[tuple[int, int], list[int]] = {}  # span -> ids of its COMMITs so far

    def add(kind: ActionKind, index: int, deps: Sequence[int] = (), to_device: int | None = None) -> int:
        actions.append(Action(len(actions), kind, index, tasks[index], tuple(deps), to_device))  # deps ascending
        return len(actions) - 1

    for index, task in enumerate(tasks):
        upload = add(ActionKind.UPLOAD, index)
        fed_by = send_of_round.get(task.round_index)
        compute = add(ActionKind.COMPUTE, index, [upload] if fed_by is None else [fed_by, upload])
        receiver = next_in_round[index]
        send_of_round[task.round_index] = add(ActionKind.SEND, index, [compute],
                                              None if receiver is None else tasks[receiver].device_index)
        if task.kind in BACKWARD_KINDS:
            commits = commits_of_stage.setdefault(task.span, [])
            commits.append(add(ActionKind.COMMIT, index, [compute]))
            if last_of_stage[task.span] == index:
                add(ActionKind.STEP, index, commits)
    return actions


class TaskLink(NamedTuple):
    """Where one task's inputs come from and where its outputs go."""

    source: int | None  # the schedule index of the task whose outputs are its inputs; None: the caller's
    send_to: int | None  # the device its outputs go to; None: the caller


def task_links(actions: Sequence[Action]) -> list[TaskLink]:
    """Per task of the lowered schedule, in schedule order: its `TaskLink`, read off its COMPUTE and SEND."""
    sources: dict[int, int | None] = {}
    send_to: dict[int, int | None] = {}
    for action in actions:
        if action.kind is ActionKind.COMPUTE:
            fed_by = [actions[d] for d in action.deps if actions[d].kind is ActionKind.SEND]
            sources[action.task_index] = fed_by[0].task_index if fed_by else None
        elif action.kind is ActionKind.SEND:
            send_to[action.task_index] = action.to_device
    return [TaskLink(sources[index], send_to[index]) for index in range(len(sources))]
