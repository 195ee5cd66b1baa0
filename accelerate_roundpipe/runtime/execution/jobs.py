"""What one pass (iteration) and one dispatched task carry between the caller and the workers.

[Note: a pass's plan and results]
A pass is two objects. `PassPlan` is what the pass is (its index, mode, micro-batch rows, which layer inputs it
saves, its labels and loss weights, its RNG stream, ...): built whole by the engine before the pass is dispatched
and frozen, so no thread can change what another reads. `PassResults` is what the pass's tasks leave behind (the
saved layer inputs, the losses, the outputs, the deferred commit they route gradients to, the planner's profile):
owned by the pass, changed only through its methods. When the pass's last task is done the dispatcher calls
`PassResults.check_drained()`: everything put in must have been taken out (every saved input read back by a
backward, the losses and the outputs read by the caller), else it raises naming what was left, which would
otherwise be host memory held until the pass was collected and, worse, a backward that silently read nothing. A
forward kept for a later backward (`model(...)` with grad enabled) hands its saved inputs over to the backward's
results (`hand_over_saved_inputs`), whose end checks them read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...plan.schedule import Mode, Task
from ..common.sync import FailureFlag, Future
from .deferred import DeferredCommit

HostTuple = tuple  # tuple of host tensors (None for "no gradient")
SavedInputs = dict  # (layer, micro-batch) -> the layer's input, kept for the backward ([Note: saved inputs])


@dataclass(frozen=True, eq=False)
class PassPlan:
    """One forward_backward / forward / backward call: what it is ([Note: a pass's plan and results])."""

    index: int  # pass number
    mode: Mode
    training: bool
    microbatch_rows: tuple[int, ...]
    saved_layers: frozenset[int] = frozenset()
    labels: tuple[Any, ...] | None = None
    loss_fn: Callable | None = None
    loss_weights: tuple[float, ...] = ()  # per micro-batch, grad scale included
    # Saved layer inputs may stay on the device while its allocated memory is below this ([Note: saved inputs]).
    keep_limit_bytes: int = 0
    # A task after the next may have its parameters prefetched while the device's allocated memory, with them,
    # stays below this ([Note: shared frozen weights]); 0: never.
    lookahead_limit_bytes: int = 0
    input_dtypes: tuple = ()  # the floating dtypes of the pass's inputs, for a dtype error's explanation
    reads_newest: bool = False  # an evaluation pass reads the newest weights, not the stash (see the optimizer)
    adapter_setting: tuple = ()  # PEFT's switches its forward runs with ([Note: adapter switches])
    buffer_reading: tuple = ()  # the layers' buffers its forward ran with ([Note: layer buffers followed])
    # The key of its layers' RNG streams: the count of training passes before it, or -(n + 1) for the n-th
    # evaluation pass ([Note: RNG streams of passes] in rng_streams.py).
    rng_stream: int = 0

    @property
    def num_microbatches(self) -> int:
        return len(self.microbatch_rows)


class PassResults:
    """What one pass's tasks leave behind, until the caller or a later task takes it; checked empty when the pass
    ends ([Note: a pass's plan and results])."""

    def __init__(self, index: int, *, num_losses: int = 0, deferred: DeferredCommit | None = None,
                 profile: Any = None, saved_inputs: SavedInputs | None = None) -> None:
        self.index = index
        self.deferred = deferred  # the commit its gradients are routed to ([Note: deferred gradient commit])
        self.profile = profile  # a LayerProfile while the pass is measured for the planner
        self._saved: SavedInputs = saved_inputs if saved_inputs is not None else {}
        self._losses = [Future(f"loss of micro-batch {m}") for m in range(num_losses)]
        self._outputs: list[Future] = []  # what the pass's last task of each micro-batch gives
        # The caller came for the losses / outputs: an interrupted wait (Ctrl-C in a notebook) leaves them
        # untaken, which the end-of-pass check must not report as a RoundPipe bug.
        self._claimed = {"losses": False, "outputs": False}

    # ---------------------------------------------------------------- saved layer inputs (worker threads)

    def save_input(self, layer: int, microbatch: int, payload: Any) -> None:
        self._saved[(layer, microbatch)] = payload

    def saved_input(self, layer: int, microbatch: int) -> Any:
        """The saved input, left in place (for inspection)."""
        return self._saved[(layer, microbatch)]

    def take_saved_input(self, layer: int, microbatch: int) -> Any:
        return self._saved.pop((layer, microbatch))

    def hand_over_saved_inputs(self) -> SavedInputs:
        """The saved inputs, for the results of the backward that will read them; this pass keeps none."""
        saved, self._saved = self._saved, {}
        return saved

    # ---------------------------------------------------------------- losses and outputs

    def set_loss(self, microbatch: int, payload: Any) -> None:
        self._losses[microbatch].set(payload)

    def take_losses(self, failure: FailureFlag) -> list[Any]:
        """Wait for every micro-batch's loss and take them."""
        self._claimed["losses"] = True
        losses = [f.take(failure) for f in self._losses]
        self._losses = []
        return losses

    def expect_outputs(self, outputs: list[Future]) -> None:
        """The futures the caller takes the pass's outputs from, one per micro-batch (set by the dispatcher)."""
        self._outputs = list(outputs)

    def take_outputs(self, failure: FailureFlag) -> list[Any]:
        self._claimed["outputs"] = True
        outputs = [f.take(failure) for f in self._outputs]
        self._outputs = []
        return outputs

    # ---------------------------------------------------------------- the end of the pass

    def check_drained(self) -> None:
        """Raise when the pass's last task is done and something it left was never taken."""
        left = []
        if self._saved:
            where = ", ".join(f"(layer {layer}, micro-batch {mb})" for layer, mb in sorted(self._saved)[:8])
            left.append(f"{len(self._saved)} saved layer input(s) never read back by a backward: {where}")
        if self._losses and not self._claimed["losses"]:
            left.append(f"{len(self._losses)} micro-batch loss(es) never read by the caller")
        if self._outputs and not self._claimed["outputs"]:
            left.append(f"{len(self._outputs)} micro-batch output(s) never read by the caller")
        if left:
            self._saved, self._losses, self._outputs = {}, [], []  # reported once
            raise RuntimeError(f"pass {self.index} ended with results left in it: {'; '.join(left)}. Its tasks "
                               f"left what nothing took (a schedule whose saved layers and backward disagree?); "
                               f"this is a RoundPipe bug: please report it with the RoundPipeConfig.")


@dataclass(eq=False)
class TaskJob:
    task: Task
    plan: PassPlan
    results: PassResults
    inputs: list[Future]  # per micro-batch of the round: activations (F, FB) or output gradients (B)
    outputs: list[Future]
    read_tickets: list[tuple[int, int]]  # (bucket, epoch) for every bucket the task uploads
    grad_tickets: list[tuple[int, int]]  # (bucket, ticket) for every trainable bucket it commits gradients to
    schedule_index: int
    next_worker: int | None = None  # the worker of the next task of the round (None: the caller reads the result)
    keep_saved: frozenset[int] = frozenset()  # layers whose saved input this worker's backward will read
    done: Future = field(default_factory=lambda: Future("a task to finish"))
