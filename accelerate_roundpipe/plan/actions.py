"""What a schedule does, one action at a time: uploads, computes, sends, commits and steps, with their inputs.

Grammar of an action string: `{id}:{KIND} t{task index} {task}[ >{receiver}][ <{dependency ids}]`, e.g.
`4:COMPUTE t1 FB1:L1-1:r0:m0-1@d1 <2,3` (action 4 runs task 1 of the schedule once actions 2 and 3 are done) or
`5:SEND t1 FB1:L1-1:r0:m0-1@d1 >d0 <4` (task 1's outputs go to device 0). `lowering.lower_schedule` makes them
from a schedule ([Note: schedule lowering]); `action_checks.validate_actions` checks them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from enum import Enum
from typing import NamedTuple

from .schedule import Task


class ActionKind(str, Enum):
    UPLOAD = "UPLOAD"  # the task's layers' buckets, host to its device
    COMPUTE = "COMPUTE"  # the task (F, FB or B) over its micro-batches
    SEND = "SEND"  # the task's outputs to the next task of its round, or to the caller after the round's last
    COMMIT = "COMMIT"  # a backward (B, FB) task's gradients, device to host
    STEP = "STEP"  # the pass's gradients of the task's layers are all committed: the optimizer may step them

    def __str__(self) -> str:
        return self.value


CALLER = "caller"  # where a round's last SEND goes: the caller reads it (loss, outputs, input gradients)

_ACTION_RE = re.compile(r"^(\d+):([A-Z]+) t(\d+) (\S+)(?: >(caller|d\d+))?(?: <(\d+(?:,\d+)*))?$")


class Action(NamedTuple):
    """One action of a lowered schedule. Its dependencies come earlier in the list. Between two actions over the
    same micro-batches a dependency holds per micro-batch (micro-batch m waits only for micro-batch m: the
    pipelining inside a round); otherwise it holds for the whole action."""

    id: int  # its position in the list
    kind: ActionKind
    task_index: int  # the position of its task in the schedule
    task: Task
    deps: tuple[int, ...] = ()
    to_device: int | None = None  # SEND only: the device of the round's next task; None: the caller

    @property
    def device(self) -> int | None:
        """The device it runs on; None for a STEP (the host's optimizer)."""
        return None if self.kind is ActionKind.STEP else self.task.device_index

    def __str__(self) -> str:
        text = f"{self.id}:{self.kind.value} t{self.task_index} {self.task}"
        if self.kind is ActionKind.SEND:
            text += f" >{CALLER if self.to_device is None else f'd{self.to_device}'}"
        if self.deps:
            text += " <" + ",".join(str(d) for d in self.deps)
        return text

    __repr__ = __str__

    @classmethod
    def from_str(cls, text: str) -> Action:
        match = _ACTION_RE.match(text.strip())
        if match is None or match.group(2) not in ActionKind.__members__:
            raise ValueError(f"not an action string: {text!r} (expected e.g. '4:COMPUTE t1 FB1:L1-1:r0:m0-1@d1 <2,3'"
                             f" or '5:SEND t1 FB1:L1-1:r0:m0-1@d1 >d0 <4')")
        ident, kind, task_index, task, receiver, deps = match.groups()
        kind = ActionKind(kind)
        if (receiver is not None) != (kind is ActionKind.SEND):
            raise ValueError(f"not an action string: {text!r} (a receiver '>d0' or '>caller' goes with SEND only)")
        to_device = None if receiver in (None, CALLER) else int(receiver[1:])
        return cls(int(ident), kind, int(task_index), Task.from_str(task),
                   tuple(int(d) for d in deps.split(",")) if deps else (), to_device)


class ActionError(ValueError):
    pass


def format_actions(actions: Sequence[Action], error_index: int | None = None) -> str:
    """One action per line (its string form), under a header; `error_index` marks a line."""
    lines = [f"{len(actions)} actions: id:KIND t<task index> <task> [>receiver] [<inputs]", "-" * 60]
    for index, action in enumerate(actions):
        lines.append(str(action) + ("  <-- ERROR HERE" if index == error_index else ""))
    return "\n".join(lines)
