"""One thread per device: runs its tasks in dispatch order (one interpreter per task kind)."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence

import torch

from ..plan.schedule import Task, TaskKind, format_schedule
from . import faults
from .device import Device, stream_seed
from .host_store import HostStore
from .jobs import TaskJob
from .layer_copy import LayerCopy
from .sync import FailureFlag, mark_engine_thread

logger = logging.getLogger(__name__)


def as_tuple(value, what: str) -> tuple[torch.Tensor, ...]:
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in value):
        return tuple(value)
    raise TypeError(f"{what} returned {type(value).__name__}; RoundPipe layers must return a tensor or a tuple of "
                    f"tensors (no None, dicts or Python numbers) so outputs can move between devices.")


def _wants_grad(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _backward(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])


def _commit_deferred(deferred, bucket, grad: torch.Tensor) -> torch.Tensor | None:
    """Route a deferred pass's gradients ([Note: deferred gradient commit]); returns what to commit directly."""
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


class Worker:
    def __init__(self, device: Device, store: HostStore, failure: FailureFlag, recompute: str,
                 base_seed: int, num_devices: int) -> None:
        self.device = device
        self.num_devices = num_devices
        self.store = store
        self.failure = failure
        self.recompute = recompute
        self.base_seed = base_seed
        self.copies: dict[int, LayerCopy] = {}
        self.queue: queue.Queue[TaskJob | None] = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name=f"roundpipe-{device}", daemon=True)
        self.schedules: dict[int, list[Task]] = {}  # pass index -> schedule, for error reports

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.queue.put(None)

    def _loop(self) -> None:
        mark_engine_thread()
        try:
            self.device.start_thread()
        except BaseException as error:  # noqa: BLE001 - reported to the caller
            self.failure.fail(error, f"worker {self.device} start-up")
        while True:
            job = self.queue.get()
            if job is None:
                return
            try:
                if self.failure.error is None:
                    self._run(job)
            except BaseException as error:  # noqa: BLE001 - reported to the caller
                where = f"worker {self.device} running task {job.task} of pass {job.state.index}"
                if self.failure.error is None:
                    logger.error("[%s] %s failed:\n%s", self.device, job.task,
                                 format_schedule(self.schedules.get(job.state.index, []), self.num_devices,
                                                 job.schedule_index))
                self.failure.fail(error, where)
            finally:
                job.done.set(True)

    # ----------------------------------------------------------------- helpers

    def _copy(self, layer_index: int) -> LayerCopy:
        copy = self.copies.get(layer_index)
        if copy is None:
            copy = LayerCopy(self.store.layers[layer_index], layer_index, self.store.layer_bindings[layer_index],
                             self.device.device)
            self.copies[layer_index] = copy
        return copy

    def _upload_params(self, job: TaskJob, with_grad: bool) -> dict[int, torch.Tensor]:
        flats = {}
        for bucket_index, epoch in job.read_tickets:
            bucket = self.store.buckets[bucket_index]
            bucket.reads.begin_read(epoch, self.failure, f"{bucket} version {epoch} for {job.task}")
            flats[bucket_index] = self.device.upload(bucket.compute)
        self.device.synchronize()  # the host copy may be rewritten once the reads are released
        for bucket_index, epoch in job.read_tickets:
            self.store.buckets[bucket_index].reads.end_read(epoch)
        if with_grad:
            for bucket_index, flat in flats.items():
                if self.store.buckets[bucket_index].trainable:
                    flat.requires_grad_(True)
        return flats

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

    def _upload_inputs(self, host: tuple, requires_grad: bool) -> tuple:
        out = []
        for t in host:
            d = self.device.upload(t)
            if requires_grad and _wants_grad(d):
                d.requires_grad_(True)
            out.append(d)
        return tuple(out)

    def _download_grads(self, inputs: tuple) -> tuple:
        return tuple(self.device.download(t.grad) if t.requires_grad and t.grad is not None else None
                     for t in inputs)

    def _commit(self, job: TaskJob, flats: dict[int, torch.Tensor]) -> None:
        host = {}
        for bucket_index, _ in job.grad_tickets:
            grad = flats[bucket_index].grad
            host[bucket_index] = None if grad is None else self.device.download(grad)
        self.device.synchronize()
        for bucket_index, ticket in job.grad_tickets:
            bucket = self.store.buckets[bucket_index]
            bucket.grads.begin(ticket, self.failure, f"gradient turn {ticket} of {bucket} for {job.task}")
            try:
                faults.point("commit")
                grad = host[bucket_index]
                if grad is not None and job.state.deferred is not None:
                    grad = _commit_deferred(job.state.deferred, bucket, grad)
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

    def _run(self, job: TaskJob) -> None:
        faults.point("worker.task")
        kind = job.task.kind
        with self.device.compute():
            if kind is TaskKind.FORWARD:
                self._forward(job)
            elif kind is TaskKind.FUSED:
                self._fused(job)
            else:
                self._backward_task(job)

    def _forward(self, job: TaskJob) -> None:
        task, state = job.task, job.state
        flats = self._upload_params(job, with_grad=False)
        for j, mb in enumerate(range(*task.microbatches)):
            host_in = job.inputs[j].take(self.failure)
            with torch.no_grad():
                self._bind(task.span.layers, flats)
                h = self._upload_inputs(host_in, requires_grad=False)
                for layer in task.span.layers:
                    if layer in state.saved_layers:
                        state.saved[(layer, mb)] = tuple(self.device.download(t) for t in h)
                    h = self._run_layer(job, layer, mb, h)
                out = tuple(self.device.download(t) for t in h)
            self.device.synchronize()
            job.outputs[j].set(out)

    def _fused(self, job: TaskJob) -> None:
        task, state = job.task, job.state
        flats = self._upload_params(job, with_grad=True)
        needs_input_grad = task.span.start > 0
        for j, mb in enumerate(range(*task.microbatches)):
            host_in = job.inputs[j].take(self.failure)
            with torch.enable_grad():
                self._bind(task.span.layers, flats)
                inputs = self._upload_inputs(host_in, requires_grad=needs_input_grad)
                h = inputs
                for layer in task.span.layers:
                    h = self._run_layer(job, layer, mb, h)
                loss = self._loss(state, h, mb)
                if loss.requires_grad:
                    (loss * state.loss_weights[mb]).backward()
            grads = self._download_grads(inputs)
            loss_host = self.device.download(loss)
            self.device.synchronize()
            state.losses[mb].set(loss_host)
            job.outputs[j].set(grads)
        self._commit(job, flats)

    def _loss(self, state, outputs: tuple, mb: int) -> torch.Tensor:
        if state.loss_fn is None:
            if len(outputs) != 1 or outputs[0].dim() != 0:
                raise TypeError(f"without loss_fn the last layer must return the loss as a 0-dim tensor; it returned "
                                f"shapes {[tuple(o.shape) for o in outputs]}. Pass loss_fn=... to forward_backward.")
            return outputs[0]
        labels = state.labels[mb]
        if labels is not None:
            labels = tuple(self.device.upload(t) for t in labels)
            labels = labels[0] if len(labels) == 1 else labels
        preds = outputs[0] if len(outputs) == 1 else outputs
        loss = state.loss_fn(preds, labels) if labels is not None else state.loss_fn(preds)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise TypeError(f"loss_fn must return a 0-dim tensor, got {type(loss).__name__} "
                            f"{tuple(getattr(loss, 'shape', ()))}.")
        return loss

    def _backward_task(self, job: TaskJob) -> None:
        task, state = job.task, job.state
        flats = self._upload_params(job, with_grad=True)
        needs_input_grad = task.span.start > 0
        for j, mb in enumerate(range(*task.microbatches)):
            host_grads = job.inputs[j].take(self.failure)
            with torch.enable_grad():
                if self.recompute == "layer":
                    grads = tuple(None if g is None else self.device.upload(g) for g in host_grads)
                    for layer in reversed(task.span.layers):
                        self._bind(range(layer, layer + 1), flats)
                        inputs = self._upload_inputs(state.saved.pop((layer, mb)),
                                                     requires_grad=needs_input_grad or layer > task.span.start)
                        _backward(self._run_layer(job, layer, mb, inputs), grads)
                        grads = tuple(t.grad if t.requires_grad else None for t in inputs)
                    out = tuple(None if g is None else self.device.download(g) for g in grads) \
                        if needs_input_grad else ()
                else:
                    self._bind(task.span.layers, flats)
                    inputs = self._upload_inputs(state.saved.pop((task.span.start, mb)), needs_input_grad)
                    h = inputs
                    for layer in task.span.layers:
                        h = self._run_layer(job, layer, mb, h)
                    _backward(h, [None if g is None else self.device.upload(g) for g in host_grads])
                    out = self._download_grads(inputs)
            self.device.synchronize()
            job.outputs[j].set(out)
        self._commit(job, flats)
