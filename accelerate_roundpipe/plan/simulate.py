"""Discrete-event replay of a RoundPipe schedule with given costs: busy and idle time per device.

Each device runs its tasks in dispatch order and a task's micro-batches in order. Micro-batch m of a task can start
once the device is free and micro-batch m of the previous task of the same round has finished (its activations or
activation gradients are the input). This is the dependency structure the runtime enforces.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

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
    device_free = [0.0] * num_devices
    busy = [0.0] * num_devices
    previous_in_round: dict[int, Task] = {}
    finish: dict[tuple[Task, int], float] = {}
    for task in tasks:
        before = previous_in_round.get(task.round_index)
        for mb in range(*task.microbatches):
            ready = finish[(before, mb)] if before is not None else 0.0
            start = max(device_free[task.device_index], ready)
            duration = cost(task, mb)
            finish[(task, mb)] = start + duration
            device_free[task.device_index] = start + duration
            busy[task.device_index] += duration
        previous_in_round[task.round_index] = task
    makespan = max(device_free)
    return SimulationResult(makespan, tuple(busy), tuple(makespan - b for b in busy))
