"""One thread per device: runs its tasks in dispatch order (one interpreter per task kind).

Each worker also has a commit thread that adds the gradients it downloaded to the host store (so the device moves
on to its next task at once), and it starts uploading the next task's parameters while the current task computes.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
from collections.abc import Sequence

import torch

from ..plan.schedule import Task, TaskKind, format_schedule
from ..telemetry.trace import TraceRecorder, maybe_span
from . import faults
from .deferred import route_commit
from .device import Device, Payload, stream_seed
from .host_store import HostStore
from .jobs import TaskJob
from .layer_copy import LayerCopy
from .sync import FailureFlag, SerialExecutor, mark_engine_thread

logger = logging.getLogger(__name__)


def as_tuple(value, what: str) -> tuple[torch.Tensor, ...]:
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in value):
        return tuple(value)
    raise TypeError(f"{what} returned {type(value).__name__}; RoundPipe layers must return a tensor or a tuple of "
                    f"tensors (no None, dicts or Python numbers) so outputs can move between devices.")


def _as_leaves(tensors: tuple, requires_grad: bool) -> tuple:
    """Fresh autograd leaves over the received tensors (floating ones require grad when asked)."""
    out = []
    for t in tensors:
        leaf = t.detach()
        if requires_grad and (leaf.is_floating_point() or leaf.is_complex()):
            leaf.requires_grad_(True)
        out.append(leaf)
    return tuple(out)


def _backward(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])


def _input_grads(inputs: tuple) -> tuple:
    return tuple(t.grad if t.requires_grad else None for t in inputs)


def _explain_oom(error: BaseException, job: TaskJob) -> BaseException:
    rows = max(job.state.microbatch_rows) if job.state.microbatch_rows else 0
    explained = torch.cuda.OutOfMemoryError(
        f"{error}\n[RoundPipe] task {job.task} ran out of GPU memory with micro-batches of up to {rows} rows. "
        f"Knobs, cheapest first: raise num_microbatches (env ROUNDPIPE_NUM_MICROBATCHES) for smaller micro-batches; "
        f"set recompute='layer' (env ROUNDPIPE_RECOMPUTE) to recompute one layer at a time; give the backward "
        f"fewer layers per stage with backward_stages (env ROUNDPIPE_BACKWARD_STAGES); shorten the sequences.")
    explained.__cause__ = error
    return explained


class _ParamUpload:
    """Parameters of one task in flight to the device, and the read tickets held until the copy completes."""

    __slots__ = ("flats", "event", "tickets")

    def __init__(self, flats: dict[int, torch.Tensor], event, tickets: list[tuple[int, int]]) -> None:
        self.flats, self.event, self.tickets = flats, event, tickets


class Worker:
    def __init__(self, device: Device, store: HostStore, failure: FailureFlag, recompute: str,
                 base_seed: int, num_devices: int, trace: TraceRecorder | None = None) -> None:
        self.device = device
        self.trace = trace
        device.trace = trace
        self.num_devices = num_devices
        self.store = store
        self.failure = failure
        self.recompute = recompute
        self.base_seed = base_seed
        self.copies: dict[int, LayerCopy] = {}
        self.queue: queue.Queue[TaskJob | None] = queue.Queue()
        self._lookahead: collections.deque[TaskJob | None] = collections.deque()
        self._prefetched: dict[int, _ParamUpload] = {}  # id(job) -> its parameters already in flight
        self.thread = threading.Thread(target=self._loop, name=f"roundpipe-{device}", daemon=True)
        self.committer: SerialExecutor | None = None
        self.schedules: dict[int, list[Task]] = {}  # pass index -> schedule, for error reports

    def start(self) -> None:
        self.committer = SerialExecutor(self.failure, f"roundpipe-commit-{self.device}")
        self.thread.start()

    def stop(self) -> None:
        self.queue.put(None)
        if self.committer is not None:
            self.committer.stop()

    @property
    def threads(self) -> list[threading.Thread]:
        return [self.thread] + ([self.committer.thread] if self.committer is not None else [])

    def _next_job(self) -> TaskJob | None:
        return self._lookahead.popleft() if self._lookahead else self.queue.get()

    def _peek_job(self) -> TaskJob | None:
        if not self._lookahead:
            try:
                self._lookahead.append(self.queue.get_nowait())
            except queue.Empty:
                return None
        return self._lookahead[0]

    def _loop(self) -> None:
        mark_engine_thread()
        try:
            self.device.start_thread()
        except BaseException as error:  # noqa: BLE001 - reported to the caller
            self.failure.fail(error, f"worker {self.device} start-up")
        while True:
            job = self._next_job()
            if job is None:
                return
            committing = False
            try:
                if self.failure.error is None:
                    committing = self._run(job)
            except BaseException as error:  # noqa: BLE001 - reported to the caller
                if isinstance(error, torch.cuda.OutOfMemoryError):
                    error = _explain_oom(error, job)
                where = f"worker {self.device} running task {job.task} of pass {job.state.index}"
                if self.failure.error is None:
                    logger.error("[%s] %s failed:\n%s", self.device, job.task,
                                 format_schedule(self.schedules.get(job.state.index, []), self.num_devices,
                                                 job.schedule_index))
                self.failure.fail(error, where)
            finally:
                if not committing:
                    job.done.set(True)

    # ----------------------------------------------------------------- parameters

    def _copy(self, layer_index: int) -> LayerCopy:
        copy = self.copies.get(layer_index)
        if copy is None:
            copy = LayerCopy(self.store.layers[layer_index], layer_index, self.store.layer_bindings[layer_index],
                             self.device.device)
            self.copies[layer_index] = copy
        return copy

    def _start_upload(self, job: TaskJob, wait: bool) -> _ParamUpload | None:
        """Issue the uploads of `job`'s parameters; without `wait`, only if every version it needs is ready."""
        buckets = self.store.buckets
        if not wait and not all(buckets[b].reads.version >= epoch for b, epoch in job.read_tickets):
            return None
        hosts = []
        for bucket_index, epoch in job.read_tickets:
            buckets[bucket_index].reads.begin_read(epoch, self.failure,
                                                   f"{buckets[bucket_index]} version {epoch} for {job.task}")
            hosts.append(buckets[bucket_index].compute)
        flats, event = self.device.upload_params(hosts)
        upload = _ParamUpload({b: f for (b, _), f in zip(job.read_tickets, flats)}, event, job.read_tickets)
        if event is None:
            self._release(upload)
        return upload

    def _release(self, upload: _ParamUpload) -> None:
        """Release the read tickets once the copy has read the host buffers."""
        if upload.event is not None:
            upload.event.synchronize()
            upload.event = None
        for bucket_index, epoch in upload.tickets:
            self.store.buckets[bucket_index].reads.end_read(epoch)
        upload.tickets = []

    def _params(self, job: TaskJob, with_grad: bool) -> tuple[dict[int, torch.Tensor], _ParamUpload]:
        upload = self._prefetched.pop(id(job), None) or self._start_upload(job, wait=True)
        self.device.use_params(list(upload.flats.values()), upload.event)
        nxt = self._peek_job()
        if nxt is not None and id(nxt) not in self._prefetched:
            early = self._start_upload(nxt, wait=False)  # overlaps this task's compute
            if early is not None:
                self._prefetched[id(nxt)] = early
        flats = upload.flats
        if with_grad:
            for bucket_index, flat in flats.items():
                if self.store.buckets[bucket_index].trainable:
                    flat.requires_grad_(True)
        return flats, upload

    def _bind(self, layers: range, flats: dict[int, torch.Tensor]) -> None:
        # Fresh views per micro-batch: each backward frees its graph, the views' included.
        views = {b: self.store.buckets[b].views(flat) for b, flat in flats.items()}
        for layer in layers:
            self._copy(layer).bind(views)

    def _run_layer(self, job: TaskJob, layer_index: int, microbatch: int, args: tuple) -> tuple:
        copy = self._copy(layer_index)
        copy.set_training(job.state.training)
        versions = copy.buffer_versions()
        with self.device.rng(stream_seed(self.base_seed, job.state.index, layer_index, microbatch)):
            out = copy.module(*args)
        copy.check_stateless(versions)
        return as_tuple(out, f"layer {layer_index} ({copy.kind})")

    def _send_next(self, job: TaskJob, tensors: tuple) -> Payload:
        return self.device.send(tensors, keep_on_device=job.next_worker == self.device.index)

    # ----------------------------------------------------------------- gradients

    def _commit(self, job: TaskJob, flats: dict[int, torch.Tensor]) -> bool:
        """Download the task's gradients and let the commit thread add them to the host; sets `job.done`."""
        if not job.grad_tickets:
            return False
        grads = [flats[b].grad for b, _ in job.grad_tickets]
        present = [g for g in grads if g is not None]
        payload = self.device.download_grads(present)
        host = iter(payload.tensors)
        downloaded = [None if g is None else next(host) for g in grads]
        self.committer.submit(lambda: self._commit_on_host(job, payload, downloaded))
        return True

    def _commit_on_host(self, job: TaskJob, payload: Payload, grads: list) -> None:
        try:
            with maybe_span(self.trace, f"{self.device} commit", f"{job.task} download"):
                payload.host()
            with maybe_span(self.trace, f"{self.device} commit", f"{job.task} add"):
                self._add_grads(job, grads)
        finally:
            job.done.set(True)

    def _add_grads(self, job: TaskJob, grads: list) -> None:
        for (bucket_index, ticket), grad in zip(job.grad_tickets, grads):
            bucket = self.store.buckets[bucket_index]
            bucket.grads.begin(ticket, self.failure, f"gradient turn {ticket} of {bucket} for {job.task}")
            try:
                faults.point("commit")
                if grad is not None and job.state.deferred is not None:
                    grad = route_commit(job.state.deferred, bucket, grad)
                if grad is not None:
                    if bucket.grad_valid:
                        bucket.grad.add_(grad)
                    else:
                        bucket.grad.copy_(grad)
                        bucket.grad_valid = True
                        bucket.attach_grads()
            finally:
                bucket.grads.end(ticket)

    # ----------------------------------------------------------------- task kinds

    def _run(self, job: TaskJob) -> bool:
        """Run one task; True when its commit thread will set `job.done`."""
        faults.point("worker.task")
        run = {TaskKind.FORWARD: self._forward, TaskKind.FUSED: self._fused}.get(job.task.kind, self._backward_task)
        with self.device.compute(), maybe_span(self.trace, f"{self.device} host", str(job.task)):
            if self.trace is None or not self.device.is_cuda:
                return run(job)
            start, end = self.trace.cuda_events(self.device.device, self.device.compute_stream)
            start.record(self.device.compute_stream)
            try:
                return run(job)
            finally:
                end.record(self.device.compute_stream)
                self.trace.add_cuda_span(f"{self.device} compute", str(job.task), self.device.device, start, end)

    def _forward(self, job: TaskJob) -> bool:
        task, state = job.task, job.state
        flats, upload = self._params(job, with_grad=False)
        self._bind(task.span.layers, flats)  # no graph here, so one binding serves every micro-batch
        for j, mb in enumerate(range(*task.microbatches)):
            h = self.device.receive(job.inputs[j].take(self.failure))
            with torch.no_grad():
                for layer in task.span.layers:
                    if layer in state.saved_layers:
                        state.saved[(layer, mb)] = self.device.send(h, keep_on_device=False)
                    h = self._run_layer(job, layer, mb, h)
            job.outputs[j].set(self._send_next(job, h))
        self._release(upload)
        return False

    def _fused(self, job: TaskJob) -> bool:
        task, state = job.task, job.state
        flats, upload = self._params(job, with_grad=True)
        needs_input_grad = task.span.start > 0
        for j, mb in enumerate(range(*task.microbatches)):
            inputs = _as_leaves(self.device.receive(job.inputs[j].take(self.failure)), needs_input_grad)
            with torch.enable_grad():
                self._bind(task.span.layers, flats)
                h = inputs
                for layer in task.span.layers:
                    h = self._run_layer(job, layer, mb, h)
                loss = self._loss(state, h, mb)
                if loss.requires_grad:
                    (loss * state.loss_weights[mb]).backward()
            state.losses[mb].set(self.device.send((loss.detach(),), keep_on_device=False))
            job.outputs[j].set(self._send_next(job, _input_grads(inputs)))
        self._release(upload)
        return self._commit(job, flats)

    def _loss(self, state, outputs: tuple, mb: int) -> torch.Tensor:
        if state.loss_fn is None:
            if len(outputs) != 1 or outputs[0].dim() != 0:
                raise TypeError(f"without loss_fn the last layer must return the loss as a 0-dim tensor; it returned "
                                f"shapes {[tuple(o.shape) for o in outputs]}. Pass loss_fn=... to forward_backward.")
            return outputs[0]
        labels = state.labels[mb]
        if labels is not None:
            labels = self.device.receive(Payload(labels))
            labels = labels[0] if len(labels) == 1 else labels
        preds = outputs[0] if len(outputs) == 1 else outputs
        loss = state.loss_fn(preds, labels) if labels is not None else state.loss_fn(preds)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise TypeError(f"loss_fn must return a 0-dim tensor, got {type(loss).__name__} "
                            f"{tuple(getattr(loss, 'shape', ()))}.")
        return loss

    def _backward_task(self, job: TaskJob) -> bool:
        task, state = job.task, job.state
        flats, upload = self._params(job, with_grad=True)
        needs_input_grad = task.span.start > 0
        for j, mb in enumerate(range(*task.microbatches)):
            grads = self.device.receive(job.inputs[j].take(self.failure))
            with torch.enable_grad():
                if self.recompute == "layer":
                    for layer in reversed(task.span.layers):
                        self._bind(range(layer, layer + 1), flats)
                        saved = self.device.receive(state.saved.pop((layer, mb)))
                        inputs = _as_leaves(saved, needs_input_grad or layer > task.span.start)
                        _backward(self._run_layer(job, layer, mb, inputs), grads)
                        grads = _input_grads(inputs)
                    out = grads if needs_input_grad else ()
                else:
                    self._bind(task.span.layers, flats)
                    inputs = _as_leaves(self.device.receive(state.saved.pop((task.span.start, mb))),
                                        needs_input_grad)
                    h = inputs
                    for layer in task.span.layers:
                        h = self._run_layer(job, layer, mb, h)
                    _backward(h, grads)
                    out = _input_grads(inputs)
            job.outputs[j].set(self._send_next(job, out))
        self._release(upload)
        return self._commit(job, flats)
