"""[Note: deferred gradient commit] and everything that implements it: routing a deferred pass's gradients,
resolving them once the loss's gradient is known (or dropping them), and the loss's autograd node."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..common.sync import FailureFlag, SerialExecutor
from ..state.host_store import Bucket, HostStore


@dataclass(eq=False)
class DeferredCommit:
    """Gradients of one fused pass, committed once the loss's backward says by how much to scale them.

    [Note: deferred gradient commit]
    A stock loop calls `loss = model(**batch).loss; (loss * c).backward()`. The fused pass already ran the backward
    with the scale `expected_scale` (c0); the loss's autograd node then resolves it with the real c:
    - a bucket whose gradient buffer was empty when the pass first committed to it was written directly ("owned"):
      nothing more to do when c == c0, one in-place multiply by c/c0 otherwise, invalidated if dropped;
    - a bucket that already held gradients (accumulation) got the pass's gradients in `bucket.pending`, added
      with the factor c/c0 at resolution, discarded if dropped. The pending buffer is the download's own (no copy)
      and goes back to the pool at resolution, so it exists only while the pass is unresolved;
    - once the loss's backward has given c (usually right after `forward_backward` returns, while most buckets
      are still to commit), a later commit into a bucket that holds gradients adds with the factor c/c0 at once:
      `grad.add_(g, alpha=c/c0)` is `commit_pending`'s own operation, so nothing is held apart. Only for a bucket
      the pass commits once and whole (`single_commits`): two commits (a tied weight's two uses, head shards'
      row windows) held apart add c/c0 x (g1 + g2), which rounds otherwise than c/c0 x g1 + c/c0 x g2.
    A pass never resolved is dropped at the next pass, `optimizer.step()` or `zero_grad()`. Resolution runs as
    ticketed gradient operations, so it is ordered after the pass's commits and before anything reserved later.
    """

    expected_scale: float
    owned: dict[int, bool] = field(default_factory=dict)  # bucket -> committed straight into the empty grad buffer
    pending_started: set[int] = field(default_factory=set)
    resolved: bool = False
    ratio: float | None = None  # c / c0 once the loss's backward gave c (None: not yet, or dropped)
    # The buckets the pass commits once (a whole-bucket commit may then add at once): set before the pass is
    # enqueued; empty, everything is held apart as before.
    single_commits: frozenset[int] = frozenset()


def single_commit_buckets(tasks, store: HostStore) -> frozenset[int]:
    """The trainable buckets that exactly one task of a pass (`tasks`, its schedule) commits gradients to."""
    counts: dict[int, int] = {}
    for task in tasks:
        if task.needs_grad:
            for index in store.buckets_of_layers(task.span.layers):
                counts[index] = counts.get(index, 0) + 1
    return frozenset(index for index, count in counts.items() if count == 1 and store.buckets[index].trainable)


def route_commit(deferred: DeferredCommit, bucket: Bucket, grad: torch.Tensor,
                 window: tuple[int, int] | None = None,
                 used: frozenset[int] | None = None) -> tuple[torch.Tensor | None, bool]:
    """Where a deferred pass's gradients (of the elements `window`, [Note: row windows]; of the slots `used`,
    [Note: parameters without a gradient]) go; returns what to commit directly into the gradient buffer, and
    whether the bucket kept the download buffer itself (as its pending gradients)."""
    if deferred.owned.setdefault(bucket.index, not bucket.grad_valid):
        return grad, False
    ratio, whole = deferred.ratio, window is None or window == (0, bucket.optim.numel())
    if ratio is not None and whole and bucket.index in deferred.single_commits:
        bucket.add_scaled(grad, ratio, used)  # resolved already: added as `commit_pending` would
        return None, False
    kept = bucket.add_pending(grad, first=bucket.index not in deferred.pending_started, window=window, used=used)
    deferred.pending_started.add(bucket.index)
    return None, kept


def resolve_job(deferred: DeferredCommit, bucket: Bucket, ticket: int, ratio: float | None,
                failure: FailureFlag) -> Callable[[], None]:
    """A host job committing one bucket's deferred gradients scaled by `ratio` (c / c0), or dropping them (None)."""

    def resolve_bucket() -> None:
        bucket.grads.begin(ticket, failure, f"gradients of {bucket} for a deferred commit")
        try:
            owned = deferred.owned.get(bucket.index)
            if owned is None:
                return  # the pass left no gradient in this bucket
            if owned and ratio is None:
                bucket.clear()
            elif owned and ratio != 1.0:
                bucket.scale(ratio)
            elif bucket.index not in deferred.pending_started:
                return  # every commit was added at once (resolved before it)
            elif ratio is not None:
                bucket.commit_pending(ratio)
            else:
                bucket.drop_pending()
        finally:
            bucket.grads.end(ticket)

    return resolve_bucket


class DeferredPasses:
    """An engine's deferred passes: the one whose loss awaits its backward, and their resolution, run as ticketed
    gradient operations on a host thread of their own (started at the first resolution).

    The lagged optimizer holds this object (not the engine) to drop a pass never back-propagated before it steps
    or clears the gradients."""

    def __init__(self, store: HostStore, failure: FailureFlag) -> None:
        self.store = store
        self.failure = failure
        self.expected_scale = 1.0  # the scale a deferred loss's backward is expected to bring (c0)
        self.host_ops: SerialExecutor | None = None
        self._pending: DeferredCommit | None = None

    def expect_scale(self, scale: float) -> None:
        """Deferred passes from now on expect their loss's backward to bring gradient `scale`."""
        self.expected_scale = scale

    def awaiting_backward(self, deferred: DeferredCommit) -> None:
        """`deferred`'s loss went to the caller: drop the pass at the next `drop_pending()` unless it is resolved."""
        self._pending = deferred

    def drop_pending(self) -> None:
        """Drop the gradients of a deferred pass whose loss was never back-propagated."""
        if self._pending is not None:
            self.resolve(self._pending, None)

    def resolve(self, deferred: DeferredCommit, scale: float | None) -> None:
        """Commit (`scale` = the loss's gradient) or drop (`None`) a deferred pass's gradients."""
        if deferred.resolved:
            raise RuntimeError("backward ran twice through the same RoundPipe loss; its gradients were already "
                               "committed (or dropped by a later pass or optimizer step).")
        deferred.resolved = True
        if self._pending is deferred:
            self._pending = None
        ratio = None if scale is None else scale / deferred.expected_scale
        deferred.ratio = ratio  # commits still to come add at once ([Note: deferred gradient commit])
        with self.failure.reserving("a deferred pass's commit"):  # [Note: interrupted reservations]
            for bucket in self.store.trainable_in_backward_order:
                ticket = bucket.grads.reserve()
                self.submit(resolve_job(deferred, bucket, ticket, ratio, self.failure))

    def submit(self, job: Callable[[], None]) -> None:
        """Queue a ticketed gradient job on the host-ops thread (started at the first), in the order its turns were
        reserved: deferred resolutions, and `zero_grad()`'s ([Note: zeroing as each bucket is stepped])."""
        if self.host_ops is None:
            self.host_ops = SerialExecutor(self.failure, "roundpipe-host-ops")
        self.host_ops.submit(job)

    def wait_idle(self) -> None:
        if self.host_ops is not None:
            self.host_ops.wait_idle()


class DeferredLoss(torch.autograd.Function):
    """The loss of a deferred fused pass: its backward commits the pass's gradients scaled by the incoming
    gradient."""

    @staticmethod
    def forward(ctx, engine, passes: DeferredPasses, deferred: DeferredCommit, anchor: torch.Tensor,
                loss: torch.Tensor):
        # The loss keeps its engine, and so the engine's threads, alive until it is back-propagated or dropped.
        ctx.engine, ctx.passes, ctx.deferred = engine, passes, deferred
        return loss.detach().clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.passes.resolve(ctx.deferred, float(grad))
        return None, None, None, None, None
