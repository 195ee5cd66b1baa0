"""[Note: deferred gradient commit] and everything that implements it: routing a deferred pass's gradients,
resolving them once the loss's gradient is known (or dropping them), and the loss's autograd node."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .sync import FailureFlag


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


def route_commit(deferred: DeferredCommit, bucket, grad: torch.Tensor) -> torch.Tensor | None:
    """Where a deferred pass's gradients go; returns what to commit directly into the gradient buffer."""
    if deferred.owned.setdefault(bucket.index, not bucket.grad_valid):
        return grad
    if bucket.index in deferred.pending_started:
        bucket.pending.add_(grad)
    else:
        if bucket.pending is None:
            bucket.pending = torch.empty_like(bucket.grad)
        bucket.pending.copy_(grad)
        deferred.pending_started.add(bucket.index)
    return None


def resolve_job(deferred: DeferredCommit, bucket, ticket: int, ratio: float | None,
                failure: FailureFlag) -> Callable[[], None]:
    """A host job committing one bucket's deferred gradients scaled by `ratio` (c / c0), or dropping them (None)."""

    def resolve_bucket() -> None:
        bucket.grads.begin(ticket, failure, f"gradients of {bucket} for a deferred commit")
        try:
            owned = deferred.owned.get(bucket.index)
            if owned is None:
                return  # the pass left no gradient in this bucket
            if owned and ratio is None:
                bucket.grad_valid = False
                bucket.detach_grads()
            elif owned and ratio != 1.0:
                bucket.grad.mul_(ratio)
            elif not owned and ratio is not None:
                bucket.grad.add_(bucket.pending, alpha=ratio)
        finally:
            bucket.grads.end(ticket)

    return resolve_bucket


class DeferredLoss(torch.autograd.Function):
    """The loss of a deferred fused pass: its backward commits the pass's gradients scaled by the incoming
    gradient."""

    @staticmethod
    def forward(ctx, engine, deferred: DeferredCommit, anchor: torch.Tensor, loss: torch.Tensor):
        ctx.engine, ctx.deferred = engine, deferred
        return loss.detach().clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.engine._resolve(ctx.deferred, float(grad))
        return None, None, None, None
