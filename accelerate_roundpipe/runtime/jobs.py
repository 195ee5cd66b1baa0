"""What one pass (iteration) and one dispatched task carry between the caller and the workers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..plan.schedule import Mode, Task
from .deferred import DeferredCommit
from .sync import Future

HostTuple = tuple  # tuple of host tensors (None for "no gradient")


@dataclass(eq=False)
class PassState:
    """One forward_backward / forward / backward call: its micro-batches and what its tasks leave behind."""

    index: int  # pass number
    mode: Mode
    training: bool
    microbatch_rows: list[int]
    saved_layers: frozenset[int] = frozenset()
    labels: list[Any] | None = None
    loss_fn: Callable | None = None
    loss_weights: list[float] = field(default_factory=list)  # per micro-batch, grad scale included
    saved: dict[tuple[int, int], HostTuple] = field(default_factory=dict)  # (layer, micro-batch) -> layer input
    losses: list[Future] = field(default_factory=list)
    outputs: list[Future] = field(default_factory=list)  # what the pass's last task of each micro-batch gives
    deferred: DeferredCommit | None = None
    # Saved layer inputs may stay on the device while its allocated memory is below this ([Note: saved inputs]).
    keep_limit_bytes: int = 0
    profile: Any = None  # a LayerProfile while the pass is measured for the planner
    input_dtypes: tuple = ()  # the floating dtypes of the pass's inputs, for a dtype error's explanation
    reads_newest: bool = False  # an evaluation pass reads the newest weights, not the stash (see the optimizer)
    adapter_setting: tuple = ()  # PEFT's switches its forward ran with ([Note: adapter switches])
    # The key of its layers' RNG streams: the count of training passes before it, or -(n + 1) for the n-th
    # evaluation pass ([Note: RNG streams of passes] in device.py).
    rng_stream: int = 0

    @property
    def num_microbatches(self) -> int:
        return len(self.microbatch_rows)


@dataclass(eq=False)
class TaskJob:
    task: Task
    state: PassState
    inputs: list[Future]  # per micro-batch of the round: activations (F, FB) or output gradients (B)
    outputs: list[Future]
    read_tickets: list[tuple[int, int]]  # (bucket, epoch) for every bucket the task uploads
    grad_tickets: list[tuple[int, int]]  # (bucket, ticket) for every trainable bucket it commits gradients to
    schedule_index: int
    next_worker: int | None = None  # the worker of the next task of the round (None: the caller reads the result)
    keep_saved: frozenset[int] = frozenset()  # layers whose saved input this worker's backward will read
    done: Future = field(default_factory=lambda: Future("a task to finish"))

