"""The checks a lowered schedule passes before it is run: inputs exist and come first, every round flows in order.

`validate_actions` checks what `lowering.lower_schedule` promises ([Note: schedule lowering]): ids are positions;
every dependency exists and comes earlier; a COMPUTE waits for its UPLOAD and for the SEND of its round's previous
task (none for a round's first), that SEND going to its device with its micro-batches; each round flows up through
the forward from layer 0 and then down through the backward from where the forward ended, every backward's layers
computed forward in its round first (a backward pass's rounds have no forward); every SEND feeds one task or the
caller; every backward task commits its gradients, and each committed layer is stepped once, after all its commits.
An error names the failing action and prints the list with that action marked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .actions import CALLER, Action, ActionError, ActionKind, format_actions
from .lowering import BACKWARD_KINDS
from .schedule import TaskKind

FORWARD_KINDS = (TaskKind.FORWARD, TaskKind.FUSED)


@dataclass
class _RoundFlow:
    """Where one round stands while its actions are read in order."""

    first: int  # the id of its first COMPUTE
    tail: int | None = None  # the id of the SEND of its latest COMPUTE (None until that SEND)
    forward_done: range = range(0)  # layers computed forward, from 0 up
    backward_done: range = range(0)  # layers computed backward, from the top down
    forward_seen: bool = False
    backward_seen: bool = False


def _receiver(action: Action) -> str:
    return CALLER if action.to_device is None else f"d{action.to_device}"


def validate_actions(actions: Sequence[Action]) -> None:
    """Raise `ActionError`, with the actions printed and the failing one marked, unless `actions` is a whole pass
    lowered as [Note: schedule lowering] describes."""

    def fail(index: int, message: str) -> None:
        action = actions[index]
        raise ActionError(f"action {index} ({action.kind.value} of task t{action.task_index} {action.task}): "
                          f"{message}\n{format_actions(actions, error_index=index)}")

    upload_of: dict[int, int] = {}  # task index -> action id, and the same for the other kinds
    compute_of: dict[int, int] = {}
    send_of: dict[int, int] = {}
    commit_of: dict[int, int] = {}
    rounds: dict[int, _RoundFlow] = {}
    commits_of_layer: dict[int, list[int]] = {}
    step_of_layer: dict[int, int] = {}

    def check_compute(index: int, action: Action) -> None:
        task = action.task
        upload = upload_of.get(action.task_index)
        if upload is None or upload not in action.deps:
            fail(index, "runs without the UPLOAD of its task among its inputs")
        sends = [d for d in action.deps if actions[d].kind is ActionKind.SEND]
        for other in set(action.deps) - set(sends) - {upload}:
            fail(index, f"waits for action {other}, which is neither its task's UPLOAD nor a SEND")
        if len(sends) > 1:
            fail(index, f"is fed by SENDs {sends}: a task takes the outputs of one task")
        flow = rounds.get(task.round_index)
        if sends:
            send = actions[sends[0]]
            if flow is None or flow.tail != send.id:
                latest = f"SEND {flow.tail}" if flow is not None and flow.tail is not None else "none"
                fail(index, f"is fed by SEND {send.id}; the latest outputs of round {task.round_index} are {latest}")
            if send.to_device != task.device_index:
                fail(send.id, f"sends to {_receiver(send)} but action {index} runs on d{task.device_index}")
            if send.task.microbatches != task.microbatches:
                fail(index, f"runs micro-batches {task.microbatches.start}..{task.microbatches.stop - 1} but SEND "
                            f"{send.id} carries {send.task.microbatches.start}..{send.task.microbatches.stop - 1}")
        elif flow is not None:
            fail(index, f"no SEND feeds it, but round {task.round_index} started at action {flow.first}")
        else:
            flow = rounds[task.round_index] = _RoundFlow(first=index)
        flow.tail = None
        check_flow(index, action, flow)
        compute_of[action.task_index] = index

    def check_flow(index: int, action: Action, flow: _RoundFlow) -> None:
        start, stop = action.task.span
        layers = list(action.task.span.layers)
        if action.task.kind in FORWARD_KINDS:
            if flow.backward_seen:
                fail(index, f"runs the forward of layers {layers} after its backward started")
            repeated = range(start, min(stop, flow.forward_done.stop))
            if repeated:
                fail(index, f"repeats the forward of layers {list(repeated)}")
            if start != flow.forward_done.stop:
                fail(index, f"runs the forward of layers {layers} before the forward of layers below {start}")
            flow.forward_done, flow.forward_seen = range(stop), True
        if action.task.kind in BACKWARD_KINDS:
            if flow.forward_seen and stop > flow.forward_done.stop:
                missing = list(range(max(start, flow.forward_done.stop), stop))
                fail(index, f"runs the backward of layers {missing} before their forward")
            done = flow.backward_done
            repeated = range(max(start, done.start), min(stop, done.stop))
            if repeated:
                fail(index, f"repeats the backward of layers {list(repeated)}")
            top = done.start if flow.backward_seen else flow.forward_done.stop if flow.forward_seen else stop
            if stop != top:
                fail(index, f"runs the backward of layers {layers} before the backward of layers above {stop - 1}")
            flow.backward_done = range(start, done.stop if flow.backward_seen else stop)
            flow.backward_seen = True

    def check_own_compute(index: int, action: Action, verb: str) -> None:
        compute = compute_of.get(action.task_index)
        if action.deps != (compute,):
            fail(index, f"{verb} of action {', '.join(map(str, action.deps)) or 'none'}, not of its task's "
                        f"COMPUTE {compute}")

    for index, action in enumerate(actions):
        if action.id != index:
            fail(index, f"has id {action.id} at position {index} (an action's id is its position)")
        for dep in action.deps:
            if not 0 <= dep < len(actions):
                fail(index, f"depends on action {dep}, which does not exist")
            if dep >= index:
                fail(index, f"depends on action {dep}, which comes after it")
        task_index, kind = action.task_index, action.kind
        if kind is ActionKind.UPLOAD:
            if action.deps:
                fail(index, "an UPLOAD waits for no action here (its weights' versions are the runtime's tickets)")
            if task_index in upload_of:
                fail(index, f"uploads task t{task_index} a second time (UPLOAD {upload_of[task_index]})")
            upload_of[task_index] = index
        elif kind is ActionKind.COMPUTE:
            if task_index in compute_of:
                fail(index, f"computes task t{task_index} a second time (COMPUTE {compute_of[task_index]})")
            check_compute(index, action)
        elif kind is ActionKind.SEND:
            check_own_compute(index, action, "sends the outputs")
            if task_index in send_of:
                fail(index, f"sends the outputs of task t{task_index} a second time (SEND {send_of[task_index]})")
            send_of[task_index] = index
            rounds[action.task.round_index].tail = index
        elif kind is ActionKind.COMMIT:
            if action.task.kind not in BACKWARD_KINDS:
                fail(index, "commits gradients of a forward task, which makes none")
            check_own_compute(index, action, "commits the gradients")
            if task_index in commit_of:
                fail(index, f"commits task t{task_index} a second time (COMMIT {commit_of[task_index]})")
            commit_of[task_index] = index
            for layer in action.task.span.layers:
                if layer in step_of_layer:
                    fail(index, f"commits layer {layer} after its STEP {step_of_layer[layer]}")
                commits_of_layer.setdefault(layer, []).append(index)
        else:
            layers = list(action.task.span.layers)
            for dep in action.deps:
                if actions[dep].kind is not ActionKind.COMMIT:
                    fail(index, f"waits for action {dep}, a {actions[dep].kind.value}: a STEP waits for COMMITs")
            for layer in layers:
                if layer in step_of_layer:
                    fail(index, f"steps layer {layer} a second time (STEP {step_of_layer[layer]})")
                if layer not in commits_of_layer:
                    fail(index, f"steps layer {layer}, which no COMMIT before it committed")
                missing = [c for c in commits_of_layer[layer] if c not in action.deps]
                if missing:
                    fail(index, f"steps layers {layers} before their commit {missing[0]}")
                step_of_layer[layer] = index

    for task_index, compute in compute_of.items():
        if task_index not in send_of:
            fail(compute, "its outputs go nowhere: no SEND")
        if actions[compute].task.kind in BACKWARD_KINDS and task_index not in commit_of:
            fail(compute, "this backward COMPUTE has no COMMIT of its gradients")
    for round_index, flow in rounds.items():
        last_send = actions[flow.tail]
        if last_send.to_device is not None:
            fail(flow.tail, f"sends to {_receiver(last_send)} but no task of round {round_index} takes it")
    for layer, commits in sorted(commits_of_layer.items()):
        if layer not in step_of_layer:
            last = actions[commits[-1]]
            unstepped = [x for x in last.task.span.layers if x not in step_of_layer]
            fail(commits[-1], f"layers {unstepped} are committed but never stepped")
