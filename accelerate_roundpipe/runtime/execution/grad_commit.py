"""Gradient commits of one worker: download each bucket's gradients once the backward is done with it, and commit
them on the host in the bucket's gradient turn, on a commit thread (so the device moves on to its next task at once).
"""

from __future__ import annotations

import threading

import torch

from ...telemetry.trace import TraceRecorder, maybe_span
from ..common import faults
from ..common.sync import FailureFlag, SerialExecutor
from ..devices.device import Device
from ..devices.payload import Payload
from ..state.host_store import Bucket, HostStore
from .deferred import route_commit
from .jobs import TaskJob
from .residency import ParamResidency, TaskParams


class GradCommits:
    def __init__(self, device: Device, store: HostStore, failure: FailureFlag, residency: ParamResidency,
                 trace: TraceRecorder | None = None) -> None:
        self.device = device
        self.store = store
        self.failure = failure
        self.residency = residency
        self.trace = trace
        self.committer: SerialExecutor | None = None

    def start(self) -> None:
        self.committer = SerialExecutor(self.failure, f"roundpipe-commit-{self.device}")

    def stop(self) -> None:
        if self.committer is not None:
            self.committer.stop()

    @property
    def threads(self) -> list[threading.Thread]:
        return [self.committer.thread] if self.committer is not None else []

    def schedule(self, job: TaskJob) -> dict[int, list[tuple[int, int]]]:
        """layer -> the grad tickets whose buckets are complete once the last micro-batch's backward has passed
        that layer (the lowest layer of the span using the bucket), so each download overlaps the layers below."""
        lowest_user: dict[int, int] = {}
        for layer in job.task.span.layers:
            for bucket_index in self.store.layer_buckets[layer]:
                lowest_user.setdefault(bucket_index, layer)
        by_layer: dict[int, list[tuple[int, int]]] = {}
        for bucket_index, ticket in job.grad_tickets:
            by_layer.setdefault(lowest_user[bucket_index], []).append((bucket_index, ticket))
        return by_layer

    def commit(self, job: TaskJob, params: TaskParams, tickets: list[tuple[int, int]], last: bool) -> None:
        """Download the gradients of `tickets`' buckets and let the commit thread commit them on the host (so the
        device moves on at once); the commit of the task's `last` group sets `job.done`."""
        # Sized like the optimizer copy (the gradient's size and dtype; `bucket.grad` itself may be mid-swap).
        # A task that read only rows of a bucket downloads those rows ([Note: row windows]).
        windows = [params.windows[b] for b, _ in tickets]
        # read now, on the worker's thread, after the backward passed these buckets' layers
        used = [params.used_slots(b) for b, _ in tickets]  # [Note: parameters without a gradient]
        outs = [self._download_buffer(self.store.buckets[b], window) for (b, _), window in zip(tickets, windows)]
        payload = self.device.download_grads_into([params.grads[b] for b, _ in tickets], outs)
        if last:  # the task's compute is all queued; unbind before `job.done` can be set (callers may then look)
            self.residency.unbind()
        self.committer.submit(lambda: self._commit_on_host(job, payload, tickets, windows, used, last))

    def _download_buffer(self, bucket: Bucket, window: tuple[int, int]) -> torch.Tensor:
        """Where a bucket's gradients (elements `window`) land, in the optimizer dtype: a buffer of the host pool, or
        for a bucket kept on a device, a buffer there, which becomes its gradient buffer as a host one would
        ([Note: gradient swap], [Note: optimizer placement])."""
        return bucket.tier.download_buffer(bucket, bucket.optim[slice(*window)], self.device)  # [Note: state tiers]

    @staticmethod
    def in_backward_order(commits: dict[int, list[tuple[int, int]]]) -> list[tuple[int, int]]:
        """Every ticket of `commits` (layer -> tickets), top layer first, as a backward reaches them."""
        return [t for layer in sorted(commits, reverse=True) for t in commits[layer]]

    def finish(self, job: TaskJob, params: TaskParams, commits: dict) -> bool:
        """Commit what the last micro-batch's backward did not (a loss without grad); True if a commit was issued."""
        if commits:
            remaining = self.in_backward_order(commits)
            commits.clear()
            self.commit(job, params, remaining, last=True)
        return bool(job.grad_tickets)

    def _commit_on_host(self, job: TaskJob, payload: Payload, tickets: list[tuple[int, int]],
                        windows: list[tuple[int, int]], used: list[frozenset[int]], last: bool) -> None:
        try:
            with maybe_span(self.trace, f"{self.device} commit", f"{job.task} download"):
                *grads, squares = payload.host()
            with maybe_span(self.trace, f"{self.device} commit", f"{job.task} add"):
                self._add_grads(job, tickets, windows, used, grads, squares.tolist())
        finally:
            if last:
                job.done.set(True)

    def _add_grads(self, job: TaskJob, tickets: list[tuple[int, int]], windows: list[tuple[int, int]],
                   used: list[frozenset[int]], grads: list, squares: list[float]) -> None:
        """Commit downloaded gradients (their device-measured squared norms, and which of each bucket's parameters
        the backward reached) in their buckets' turn (a deferred pass's may be held apart instead), then return the
        spare buffer to the pool."""
        for (bucket_index, ticket), window, slots, grad, square in zip(tickets, windows, used, grads, squares):
            bucket = self.store.buckets[bucket_index]
            spare = grad  # what goes back to the pool once this commit is done
            bucket.grads.begin(ticket, self.failure, f"gradient turn {ticket} of {bucket} for {job.task}")
            try:
                faults.point("commit")
                if job.results.deferred is not None:
                    grad, kept = route_commit(job.results.deferred, bucket, grad, window, slots)
                    if kept:
                        spare = None  # the bucket's pending gradients now, given back when resolved
                if grad is not None:
                    spare = bucket.commit(grad, square, window, slots)
            except BaseException as error:
                # Flagged before the turn ends: the step waiting for this turn must not take it as committed.
                self.failure.fail(error, f"{threading.current_thread().name} (commit of {bucket})")
                raise
            finally:
                bucket.grads.end(ticket)
            if spare is not None:  # None: swapped into a bucket that held no buffer ([Note: no spare gradient buffer])
                bucket.tier.return_spare(bucket, spare)  # the pool, or a device bucket's spare ([Note: state tiers])
