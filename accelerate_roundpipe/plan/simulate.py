"""Discrete-event replay of a RoundPipe schedule with given costs: busy and idle time per device.

The schedule is lowered into actions ([Note: schedule lowering]) and the actions are replayed: each device runs its
COMPUTE actions in order and a task's micro-batches in order; micro-batch m of a COMPUTE starts once its device is
free and its inputs are ready (micro-batch m of the SEND that feeds it, so of the previous task of its round).
Uploads, sends and commits take no time here: the runtime overlaps them with compute.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .actions import Action, ActionKind
from .lowering import lower_schedule
from .schedule import Task

CostFn = Callable[[Task, int], float]


def unit_cost(task: Task, microbatch_index: int) -> float:
    return 1.0


@dataclass(frozen=True)
class SimulationResult:
    makespan: float
    busy: tuple[float, ...]  # per device
    idle: tuple[float, ...]  # per device: makespan - busy

    @property
    def bubble_ratio(self) -> float:
        total = self.makespan * len(self.busy)
        return sum(self.idle) / total if total else 0.0

    @property
    def total_idle(self) -> float:
        return sum(self.idle)


def simulate(tasks: Sequence[Task], num_devices: int, cost: CostFn = unit_cost) -> SimulationResult:
    return replay_actions(lower_schedule(tasks), num_devices, cost)


def replay_actions(actions: Sequence[Action], num_devices: int, cost: CostFn = unit_cost) -> SimulationResult:
    """Replay lowered actions; `cost(task, micro-batch)` is the time of one micro-batch of a COMPUTE."""
    device_free = [0.0] * num_devices
    busy = [0.0] * num_devices
    finish: list[dict[int, float]] = []  # per action: micro-batch -> when it is done (never changed once made)
    for action in actions:
        mbs = action.task.microbatches
        # Inputs per micro-batch from actions over the same micro-batches, after the whole action from the others
        # (see `Action`).
        per_mb = [finish[d] for d in action.deps if actions[d].task.microbatches == mbs]
        whole = max((max(finish[d].values()) for d in action.deps if actions[d].task.microbatches != mbs),
                    default=0.0)
        if action.kind is ActionKind.COMPUTE:
            device = action.task.device_index
            done: dict[int, float] = {}
            for mb in range(*mbs):
                start = device_free[device] if device_free[device] > whole else whole
                for inputs in per_mb:  # comparisons, not max(): the inner loop of every replay
                    if inputs[mb] > start:
                        start = inputs[mb]
                duration = cost(action.task, mb)
                done[mb] = device_free[device] = start + duration
                busy[device] += duration
        elif not per_mb:
            done = dict.fromkeys(range(*mbs), whole)  # an upload (no inputs here) or a step
        elif len(per_mb) == 1 and whole == 0.0:
            done = per_mb[0]  # a send or a commit: done when its compute is (it takes no time here)
        else:
            done = {mb: max([whole] + [f[mb] for f in per_mb]) for mb in range(*mbs)}
        finish.append(done)
    makespan = max(device_free)
    return SimulationResult(makespan, tuple(busy), tuple(makespan - b for b in busy))
