"""What one pass (iteration) and one dispatched task carry between the caller and the workers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..plan.schedule import Mode, Task
from .sync import Future

HostTuple = tuple  # tuple of host tensors (None for "no gradient")


@dataclass(eq=False)
class DeferredCommit:
    """Gradients of one fused pass, committed once the loss's backward says by how much to scale them.

    [Note: deferred gradient commit]
    A stock loop calls `loss = model(**batch).loss; (loss * c).backward()`. The fused pass already ran the backward
    with the scale `expected_scale` (c0); the loss's autograd node then resolves it with the real c:
    - a bucket whose gradient buffer was empty when the pass first committed to it was written directly ("owned"):
      nothing more to do when c == c0, one in-place multiply by c/c0 otherwise, invalidated if dropped;
    - a bucket that already held gradients (accumulation) got the pass's gradients in `bucket.pending`, added
      with the factor c/c0 at resolution, discarded if dropped.
    A pass never resolved is dropped at the next pass, `optimizer.step()` or `zero_grad()`. Resolution runs as
    ticketed gradient operations, so it is ordered after the pass's commits and before anything reserved later.
    """

    expected_scale: float
    owned: dict[int, bool] = field(default_factory=dict)  # bucket -> committed straight into the empty grad buffer
    pending_started: set[int] = field(default_factory=set)
    resolved: bool = False


@dataclass(eq=False)
class PassState:
    """One forward_backward / forward / backward call: its micro-batches and what its tasks leave behind."""

    index: int  # pass number, also the RNG stream of every layer run in it
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
    done: Future = field(default_factory=lambda: Future("a task to finish"))


def split_rows(tensors: tuple[torch.Tensor, ...], num_microbatches: int) -> list[tuple[torch.Tensor, ...]]:
    """Split every tensor along dim 0 into `num_microbatches` slices (the first ones one row larger if uneven)."""
    parts = [torch.tensor_split(t, num_microbatches, dim=0) for t in tensors]
    return [tuple(p[i] for p in parts) for i in range(num_microbatches)]
