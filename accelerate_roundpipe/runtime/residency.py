"""Parameter residency on one device: a task's parameters uploaded, bound into the layer copies, then released.

The host buffers are read under read tickets ([Note: per-layer events]); the next task's uploads may start while the
current task computes (`prefetch`), but only when every version it needs is already written.
"""

from __future__ import annotations

import torch

from .device import Device
from .host_store import HostStore
from .jobs import TaskJob
from .layer_copy import LayerCopy
from .sync import FailureFlag


class TaskParams:
    """Parameters of one task on the device.

    `flats[b]` is bucket b's uploaded compute copy and `events[b]` its copy event, waited for on the compute stream
    only when the first layer using the bucket runs (`pending`). For a task that computes gradients, every
    trainable parameter is a leaf view of its flat whose `.grad` is preset to a view of a zeroed flat `grads[b]`:
    autograd then accumulates each micro-batch's gradients in place into one flat buffer per bucket, ready to
    download as is (views that require grad on a flat that requires grad would instead cost a full-size zero
    tensor per parameter per backward). `tickets` are the read tickets held until the copies have read the host.
    """

    __slots__ = ("flats", "events", "pending", "tickets", "grads", "views")

    def __init__(self, flats: dict[int, torch.Tensor], events: dict[int, object],
                 tickets: list[tuple[int, int]]) -> None:
        self.flats, self.events, self.tickets = flats, events, tickets
        self.pending = {b for b, e in events.items() if e is not None}
        self.grads: dict[int, torch.Tensor] = {}
        self.views: dict[int, list[torch.Tensor]] = {}


class ParamResidency:
    """Which parameters one device holds: the layer copies, the uploads in flight and the task bound right now."""

    def __init__(self, device: Device, store: HostStore, failure: FailureFlag) -> None:
        self.device = device
        self.store = store
        self.failure = failure
        self.copies: dict[int, LayerCopy] = {}
        self._prefetched: dict[int, TaskParams] = {}  # id(job) -> its parameters already in flight
        self._bound: range = range(0)  # layers whose copies hold the running task's tensors

    def copy(self, layer_index: int) -> LayerCopy:
        copy = self.copies.get(layer_index)
        if copy is None:
            copy = LayerCopy(self.store.layers[layer_index], layer_index, self.store.layer_bindings[layer_index],
                             self.device.device)
            self.copies[layer_index] = copy
        return copy

    def _start_upload(self, job: TaskJob, wait: bool) -> TaskParams | None:
        """Issue the uploads of `job`'s parameters; without `wait`, only if every version it needs is ready."""
        buckets = self.store.buckets
        if not wait and not all(buckets[b].reads.version >= epoch for b, epoch in job.read_tickets):
            return None
        hosts = []
        for bucket_index, epoch in job.read_tickets:
            buckets[bucket_index].reads.begin_read(epoch, self.failure,
                                                   f"{buckets[bucket_index]} version {epoch} for {job.task}")
            hosts.append(buckets[bucket_index].compute)
        flats, events = self.device.upload_params(hosts)
        indices = [b for b, _ in job.read_tickets]
        params = TaskParams(dict(zip(indices, flats)), dict(zip(indices, events)), job.read_tickets)
        if not params.pending:
            self.release(params)
        return params

    def release(self, params: TaskParams) -> None:
        """Release the read tickets once the copies have read the host buffers (they run in order on one stream:
        the last event covers them all)."""
        last = next((e for e in reversed(list(params.events.values())) if e is not None), None)
        if last is not None:
            last.synchronize()
        self._end_reads(params, len(params.tickets))

    def release_landed(self, params: TaskParams) -> None:
        """[Note: early read release]
        Release the read tickets of the buckets whose copies have landed, without waiting for the others. A read
        ticket only has to outlive the copy out of the host buffer, not the task: held to the task's end, it made
        the next write-back of that bucket (and, behind it on the optimizer thread, every later step) wait for a
        whole pass. With the exact (sync) optimizer that serialised the step of iteration k behind iteration k's
        last task, so the next iteration found none of its weights ready. The copies run in ticket order on one
        stream, so the landed ones are a prefix: the first copy still in flight ends the scan."""
        landed = 0
        for bucket_index, _ in params.tickets:
            event = params.events.get(bucket_index)
            if event is not None and not event.query():
                break
            landed += 1
        self._end_reads(params, landed)

    def _end_reads(self, params: TaskParams, count: int) -> None:
        """End the first `count` read tickets of `params`."""
        for bucket_index, epoch in params.tickets[:count]:
            self.store.buckets[bucket_index].reads.end_read(epoch)
        params.tickets = params.tickets[count:]

    def take(self, job: TaskJob) -> TaskParams:
        """`job`'s parameters: the prefetched uploads, else uploads issued now (waiting for their versions)."""
        return self._prefetched.pop(id(job), None) or self._start_upload(job, wait=True)

    def prefetch(self, job: TaskJob | None) -> None:
        """Start the uploads of the next queued `job` if its versions are ready (they overlap this task's compute)."""
        if job is not None and id(job) not in self._prefetched:
            early = self._start_upload(job, wait=False)
            if early is not None:
                self._prefetched[id(job)] = early

    def bind(self, job: TaskJob, params: TaskParams, with_grad: bool) -> None:
        """Bind `params` into the layer copies of `job`'s span (once per task), with gradient buffers if asked."""
        for bucket_index, flat in params.flats.items():
            bucket = self.store.buckets[bucket_index]
            views = bucket.views(flat)
            if with_grad and bucket.trainable:
                grad = torch.zeros_like(flat)
                for view, grad_view in zip(views, bucket.views(grad)):
                    view.requires_grad_(True)
                    view.grad = grad_view
                params.grads[bucket_index] = grad
            params.views[bucket_index] = views
        for layer in job.task.span.layers:
            self.copy(layer).bind(params.views)
        self._bound = job.task.span.layers

    def await_layer(self, params: TaskParams, layer_index: int) -> None:
        """Make the compute stream wait for the buckets of `layer_index` that are still being copied."""
        self.release_landed(params)  # [Note: early read release]
        if not params.pending:
            return
        for bucket_index in self.store.layer_buckets[layer_index]:
            if bucket_index in params.pending:
                params.pending.discard(bucket_index)
                self.device.use_params([params.flats[bucket_index]], params.events[bucket_index])

    def unbind(self) -> None:
        """Unbind the running task's layer copies (once: before its last commit, else when it ends)."""
        for layer in self._bound:
            self.copy(layer).unbind()
        self._bound = range(0)
