"""What a planner returns: a partition with the time and memory the stage cost model predicts for each stage."""

from __future__ import annotations

from dataclasses import dataclass

from .partition import Partition, Span
from .schedule import TaskKind
from .stage_cost_model import PlanSettings, StageCostModel, format_bytes


@dataclass(frozen=True)
class PlannedPartition:
    """A partition with its predicted per-stage times (seconds per task) and GPU memory (bytes).

    `forward_stage_*` follow `partition.forward`, `backward_stage_*` follow `partition.backward` (the last entry is
    the fused stage).
    """

    partition: Partition
    slowest_stage_s: float
    forward_stage_s: tuple[float, ...]
    backward_stage_s: tuple[float, ...]
    forward_stage_bytes: tuple[float, ...]
    backward_stage_bytes: tuple[float, ...]
    search_s: float
    settings: PlanSettings
    # The largest stage memory besides its parameters and the next task's arriving ones (gradients, activations,
    # the backward's working set, transfers in flight): what a running task may still allocate after it started.
    peak_working_bytes: float = 0.0

    @classmethod
    def predict(cls, partition: Partition, model: StageCostModel, search_s: float) -> PlannedPartition:
        """`partition` with every stage's time and memory under `model`; `search_s` is how long finding it took."""
        kinds = [TaskKind.BACKWARD] * (len(partition.backward) - 1) + [TaskKind.FUSED]
        forward_s = tuple(model.time(TaskKind.FORWARD, *s) for s in partition.forward)
        backward_s = tuple(model.time(k, *s) for k, s in zip(kinds, partition.backward))
        return cls(
            partition=partition,
            slowest_stage_s=max(forward_s + backward_s),
            forward_stage_s=forward_s,
            backward_stage_s=backward_s,
            forward_stage_bytes=tuple(model.memory(TaskKind.FORWARD, *s) for s in partition.forward),
            backward_stage_bytes=tuple(model.memory(k, *s) for k, s in zip(kinds, partition.backward)),
            search_s=search_s,
            settings=model.settings,
            peak_working_bytes=max(_working_bytes(model, k, s) for k, s in
                                   [(TaskKind.FORWARD, s) for s in partition.forward] + list(zip(kinds,
                                                                                                 partition.backward))),
        )

    @property
    def peak_stage_bytes(self) -> float:
        """The memory of the largest stage."""
        return max(self.forward_stage_bytes + self.backward_stage_bytes)

    def rows(self) -> list[tuple[str, Span, float, float]]:
        """(stage name as the schedule writes it, span, time, memory) in round order: F_0.., FB, B_{Sb-2}..B_0."""
        p = self.partition
        top = len(p.backward) - 1
        rows = [(f"F{i}", s, t, mem) for i, (s, t, mem) in
                enumerate(zip(p.forward, self.forward_stage_s, self.forward_stage_bytes))]
        rows.append((f"FB{top}", p.fused, self.backward_stage_s[top], self.backward_stage_bytes[top]))
        rows += [(f"B{i}", p.backward[i], self.backward_stage_s[i], self.backward_stage_bytes[i])
                 for i in reversed(range(top))]
        return rows

    def __str__(self) -> str:
        s = self.settings
        lines = [f"planned {self.partition}",
                 f"slowest stage {_ms(self.slowest_stage_s)}, budget {format_bytes(s.gpu_memory_bytes)}, "
                 f"{s.num_microbatches} micro-batches per task, {s.num_devices} devices, recompute={s.recompute}, "
                 f"searched in {self.search_s * 1e3:.2f} ms",
                 f"{'stage':<6} {'layers':<10} {'time':>12} {'memory':>12}"]
        for name, span, t, mem in self.rows():
            mark = "  <- slowest" if t == self.slowest_stage_s else ""
            lines.append(f"{name:<6} {str(span):<10} {_ms(t):>12} {format_bytes(mem):>12}{mark}")
        return "\n".join(lines)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def _working_bytes(model: StageCostModel, kind: TaskKind, span: Span) -> float:
    parts = model.memory_parts(kind, *span)
    return sum(parts.values()) - parts["parameters"] - parts["prefetch"]
