"""Checks the invariants of a schedule; errors name the round and device and show the grid with the row marked."""

from __future__ import annotations

from collections.abc import Sequence

from .schedule import Mode, Task, TaskKind, format_schedule


class ScheduleError(ValueError):
    pass


def validate_schedule(tasks: Sequence[Task], num_layers: int, num_microbatches: int, num_devices: int,
                      mode: Mode | str = Mode.TRAIN) -> None:
    """Every micro-batch in exactly one round; per round, the forward of every layer exactly once and before its
    backward (fused counts as both), the backward of every layer exactly once (training), devices round-robin."""
    mode = Mode(mode)

    def fail(index: int, message: str) -> None:
        task = tasks[index]
        raise ScheduleError(f"round {task.round_index}, device {task.device_index}: {message}\n"
                            f"{format_schedule(tasks, num_devices, error_index=index)}")

    covered: list[int] = []
    rounds: dict[int, list[int]] = {}
    for index, task in enumerate(tasks):
        if index and task.device_index != (tasks[index - 1].device_index + 1) % num_devices:
            fail(index, f"task {task} breaks the round-robin order")
        rounds.setdefault(task.round_index, []).append(index)
    for indices in rounds.values():
        mbs = tasks[indices[0]].microbatches
        covered.extend(range(*mbs))
        forward_done: set[int] = set()
        backward_done: set[int] = set()
        for index in indices:
            task = tasks[index]
            if task.microbatches != mbs:
                fail(index, f"task {task} runs other micro-batches than its round ({mbs.start}..{mbs.stop - 1})")
            layers = set(task.span.layers)
            if task.kind in (TaskKind.FORWARD, TaskKind.FUSED):
                if layers & forward_done:
                    fail(index, f"task {task} repeats the forward of layers {sorted(layers & forward_done)}")
                if task.span.start != len(forward_done):
                    fail(index, f"task {task} runs before the forward of layers below {task.span.start}")
                forward_done |= layers
            if task.kind in (TaskKind.BACKWARD, TaskKind.FUSED):
                if mode is not Mode.BACKWARD and not layers <= forward_done:
                    fail(index, f"task {task} runs a backward before the forward of its layers")
                if layers & backward_done:
                    fail(index, f"task {task} repeats the backward of layers {sorted(layers & backward_done)}")
                if backward_done and task.span.stop != min(backward_done):
                    fail(index, f"task {task} runs before the backward of layers above {task.span.stop - 1}")
                backward_done |= layers
        expect_forward = mode is not Mode.BACKWARD
        expect_backward = mode is not Mode.FORWARD
        if expect_forward and forward_done != set(range(num_layers)):
            fail(indices[-1], f"round misses the forward of layers {sorted(set(range(num_layers)) - forward_done)}")
        if expect_backward and backward_done != set(range(num_layers)):
            fail(indices[-1], f"round misses the backward of layers {sorted(set(range(num_layers)) - backward_done)}")
    if sorted(covered) != list(range(num_microbatches)):
        raise ScheduleError(f"micro-batches covered {sorted(covered)} != 0..{num_microbatches - 1}")
