"""The round-robin schedule as data: a list of `Task`s with a one-line string form, built and checked together.

Grammar of a task string: `{kind}{stage}:L{first}-{last}:r{round}:m{first}-{last}@d{device}`, e.g.
`F0:L0-2:r0:m0-3@d0` (forward stage 0 over layers 0..2, round 0, micro-batches 0..3, on device 0).

[Note: round-robin dispatch]
Each round runs the stage sequence F_0..F_{Sf-1}, FB, B_{Sb-2}..B_0 (training) over its micro-batches; the k-th task
of the whole run goes to device (start + k) mod N. Rounds follow each other in one unbroken sequence and the start
rolls on across iterations (the engine keeps it), so no device restarts the pipeline. Inside a round, micro-batch m
of slot i depends only on micro-batch m of slot i-1: with N micro-batches per round the ring has no bubble, and the
run idles N(N-1) micro-batch slots in all, at warm-up and cool-down.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from enum import Enum
from typing import NamedTuple

from .partition import Partition, Span


class TaskKind(str, Enum):
    """What one task runs: the kind of its stage. A pass (see `Mode`) is a sequence of such tasks."""

    FORWARD = "F"  # forward without graph; keeps the inputs the backward recomputes from
    FUSED = "FB"  # forward with graph + loss + backward, the top stage of a training iteration
    BACKWARD = "B"  # recompute from the kept inputs + backward

    def __str__(self) -> str:
        return self.value


class Mode(str, Enum):
    """What one pass runs (one engine call: `forward_backward`, `forward` or `backward`): which stage sequence
    `build_schedule` lays out for every round. Each stage of it is a task of one `TaskKind`."""

    TRAIN = "train"  # fused forward+backward (forward_backward)
    FORWARD = "forward"  # forward stages over every layer
    BACKWARD = "backward"  # backward stages over every layer, top first


_TASK_RE = re.compile(r"^(FB|F|B)(\d+):L(\d+)-(\d+):r(\d+):m(\d+)-(\d+)@d(\d+)$")


class Task(NamedTuple):
    kind: TaskKind
    stage_index: int
    span: Span
    round_index: int
    microbatches: Span  # micro-batch indices [start, stop)
    device_index: int

    def __str__(self) -> str:
        mb = self.microbatches
        return (f"{self.kind.value}{self.stage_index}:L{self.span.start}-{self.span.stop - 1}:r{self.round_index}:"
                f"m{mb.start}-{mb.stop - 1}@d{self.device_index}")

    __repr__ = __str__

    @classmethod
    def from_str(cls, text: str) -> Task:
        match = _TASK_RE.match(text.strip())
        if match is None:
            raise ValueError(f"not a task string: {text!r} (expected e.g. 'F0:L0-2:r0:m0-3@d0')")
        kind, stage, l0, l1, rnd, m0, m1, dev = match.groups()
        return cls(TaskKind(kind), int(stage), Span(int(l0), int(l1) + 1), int(rnd), Span(int(m0), int(m1) + 1),
                   int(dev))

    @property
    def needs_grad(self) -> bool:
        return self.kind is not TaskKind.FORWARD


def round_spans(num_microbatches: int, microbatches_per_round: int) -> list[Span]:
    return [Span(s, min(s + microbatches_per_round, num_microbatches))
            for s in range(0, num_microbatches, microbatches_per_round)]


def stage_sequence(partition: Partition, mode: Mode) -> list[tuple[TaskKind, int, Span]]:
    """The stages one round runs, in order, as (kind, stage index, span)."""
    if mode is Mode.TRAIN:
        top = len(partition.backward) - 1
        return ([(TaskKind.FORWARD, i, s) for i, s in enumerate(partition.forward)]
                + [(TaskKind.FUSED, top, partition.fused)]
                + [(TaskKind.BACKWARD, i, partition.backward[i]) for i in reversed(range(top))])
    if mode is Mode.FORWARD:
        return [(TaskKind.FORWARD, i, s) for i, s in enumerate(partition.forward_all)]
    return [(TaskKind.BACKWARD, i, partition.backward[i]) for i in reversed(range(len(partition.backward)))]


def build_schedule(
    partition: Partition,
    num_microbatches: int,
    microbatches_per_round: int,
    num_devices: int,
    start_device: int = 0,
    mode: Mode | str = Mode.TRAIN,
) -> list[Task]:
    """Every task of one iteration in dispatch order, checked by `validate_schedule`. The next iteration starts at
    `(start_device + len(tasks)) % num_devices`."""
    if num_devices < 1:
        raise ValueError("need at least one device")
    if num_microbatches < 1 or microbatches_per_round < 1:
        raise ValueError("need at least one micro-batch per iteration and per round")
    mode = Mode(mode)
    stages = stage_sequence(partition, mode)
    tasks = []
    slot = start_device
    for round_index, mbs in enumerate(round_spans(num_microbatches, microbatches_per_round)):
        for kind, stage_index, span in stages:
            tasks.append(Task(kind, stage_index, span, round_index, mbs, slot % num_devices))
            slot += 1
    # A few set operations per task (tens of microseconds for a pass): cheap next to the pass it describes.
    validate_schedule(tasks, partition.num_layers, num_microbatches, num_devices, mode)
    return tasks


def format_schedule(tasks: Sequence[Task], num_devices: int, error_index: int | None = None) -> str:
    """A grid: one row per wave of N consecutive tasks, one column per device; `error_index` marks a row."""
    width = max([len(str(t)) for t in tasks] + [6])
    header = "wave | " + " | ".join(f"d{d}".ljust(width) for d in range(num_devices))
    lines = [header, "-" * len(header)]
    if not tasks:
        return "\n".join(lines)
    for wave_start in range(0, len(tasks), num_devices):
        cells = [""] * num_devices
        wave = tasks[wave_start:wave_start + num_devices]
        for task in wave:
            cells[task.device_index] = str(task)
        row = f"{wave_start // num_devices:4d} | " + " | ".join(c.ljust(width) for c in cells)
        if error_index is not None and wave_start <= error_index < wave_start + num_devices:
            row += "  <-- ERROR HERE"
        lines.append(row)
    return "\n".join(lines)


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
    forward_kinds, backward_kinds = (TaskKind.FORWARD, TaskKind.FUSED), (TaskKind.BACKWARD, TaskKind.FUSED)
    for indices in rounds.values():
        mbs = tasks[indices[0]].microbatches
        covered.extend(range(*mbs))
        # The layers done as ranges, not sets (this runs for every pass): the order checks keep each one contiguous,
        # the forward's from layer 0 up, the backward's from the top down.
        forward_done, backward_done = range(0), range(0)
        for index in indices:
            task = tasks[index]
            if task.microbatches != mbs:
                fail(index, f"task {task} runs other micro-batches than its round ({mbs.start}..{mbs.stop - 1})")
            start, stop = task.span
            if task.kind in forward_kinds:
                repeated = range(start, min(stop, forward_done.stop))
                if repeated:
                    fail(index, f"task {task} repeats the forward of layers {list(repeated)}")
                if start != len(forward_done):
                    fail(index, f"task {task} runs before the forward of layers below {start}")
                forward_done = range(max(forward_done.stop, stop))
            if task.kind in backward_kinds:
                if mode is not Mode.BACKWARD and start < stop and stop > forward_done.stop:
                    fail(index, f"task {task} runs a backward before the forward of its layers")
                repeated = range(max(start, backward_done.start), min(stop, backward_done.stop))
                if repeated:
                    fail(index, f"task {task} repeats the backward of layers {list(repeated)}")
                if backward_done and stop != backward_done.start:
                    fail(index, f"task {task} runs before the backward of layers above {stop - 1}")
                if start < stop:
                    backward_done = range(start, backward_done.stop if backward_done else stop)
        if mode is not Mode.BACKWARD and forward_done != range(num_layers):
            fail(indices[-1], f"round misses the forward of layers {list(range(len(forward_done), num_layers))}")
        if mode is not Mode.FORWARD and backward_done != range(num_layers):
            missing = [layer for layer in range(num_layers) if layer not in backward_done]
            fail(indices[-1], f"round misses the backward of layers {missing}")
    if sorted(covered) != list(range(num_microbatches)):
        raise ScheduleError(f"micro-batches covered {sorted(covered)} != 0..{num_microbatches - 1}")
