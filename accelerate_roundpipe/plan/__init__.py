"""Pure planning: partitions, schedules and their simulation. No threads, no devices, only numbers.

Vocabulary (used the same way everywhere in the package):

- layer: one entry of the model's layer list (an `nn.Sequential` child), indexed 0..L-1 from the input.
- stage: a contiguous span of layers run by one task. Forward stages and backward stages are partitioned
  independently; the top backward stage is the *fused* stage (forward + loss + backward at once, its forward doubling
  as the recomputation).
- micro-batch: a slice of the batch along dim 0. A *round* is a group of consecutive micro-batches.
- task: one stage run over all micro-batches of one round on one device (F, FB or B).
- slot: a task's position in the round's stage sequence F_0..F_{Sf-1}, FB, B_{Sb-2}..B_0; slot k of the run goes to
  device (start + k) mod N and the start rolls on across rounds and iterations.
- action: what a task does, lowered from the schedule (upload, compute, send, commit, step) with the ids of the
  actions it waits for; the one place that says which task's outputs feed which ([Note: schedule lowering]).
- iteration: one `forward_backward` (or forward, or backward) call; step: one optimizer step.
"""

from .action_checks import validate_actions
from .actions import Action, ActionError, ActionKind, format_actions
from .lowering import TaskLink, lower_schedule, task_links
from .partition import Partition, Span, plan_partition
from .schedule import Mode, ScheduleError, Task, TaskKind, build_schedule, format_schedule, validate_schedule
from .simulate import SimulationResult, replay_actions, simulate

__all__ = [
    "Action",
    "ActionError",
    "ActionKind",
    "TaskLink",
    "format_actions",
    "lower_schedule",
    "replay_actions",
    "task_links",
    "validate_actions",
    "Partition",
    "Span",
    "plan_partition",
    "Mode",
    "Task",
    "TaskKind",
    "build_schedule",
    "format_schedule",
    "SimulationResult",
    "simulate",
    "ScheduleError",
    "validate_schedule",
]
