"""One thread per device: runs its tasks in dispatch order, one interpreter per task kind (forward, fused, backward).

The parameters come and go through the device's `ParamResidency` (which starts uploading the next task's parameters
while the current task computes); the gradients leave through `GradCommits`, whose commit thread commits them to the
host store so the device moves on to its next task at once.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import threading
from collections.abc import Sequence

import torch

from ...plan.schedule import Task, TaskKind, format_schedule
from ...telemetry.trace import TraceRecorder, maybe_span
from ..common import faults
from ..common.sync import Aborted, FailureFlag, mark_engine_thread
from ..devices.device import Device
from ..devices.payload import Payload
from ..state.host_store import HostStore
from .grad_commit import GradCommits
from .jobs import PassPlan, TaskJob
from .layer_profile import LayerRun
from .residency import ParamResidency, TaskParams
from .rng_streams import stream_seed

logger = logging.getLogger(__name__)
_NO_PROFILE = contextlib.nullcontext()
MAX_TASKS_AHEAD = 2  # tasks the worker thread may queue ahead of the GPU ([Note: bounded run-ahead])


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
    rows = max(job.plan.microbatch_rows) if job.plan.microbatch_rows else 0
    explained = torch.cuda.OutOfMemoryError(
        f"{error}\n[RoundPipe] task {job.task} ran out of GPU memory with micro-batches of up to {rows} rows. "
        f"Knobs, cheapest first: raise num_microbatches (env ROUNDPIPE_NUM_MICROBATCHES) for smaller micro-batches; "
        f"set recompute='layer' (env ROUNDPIPE_RECOMPUTE) to recompute one layer at a time; give the backward "
        f"fewer layers per stage with backward_stages (env ROUNDPIPE_BACKWARD_STAGES); shorten the sequences.")
    explained.__cause__ = error
    return explained


def _explain_dtype(error: BaseException, job: TaskJob, store: HostStore) -> None:
    """A dtype mismatch inside a layer whose weights and the pass's inputs differ in dtype: say which, and what to
    change (torch's own message, e.g. "mat1 and mat2 must have the same dtype", names neither)."""
    if not isinstance(error, RuntimeError) or "dtype" not in str(error):
        return
    weights = {store.buckets[b].compute.dtype for b in store.buckets_of_layers(job.task.span.layers)}
    floating = {w for w in weights if w.is_floating_point}
    inputs = set(job.plan.input_dtypes)
    if not floating or not inputs or inputs <= floating:
        return
    names = lambda dtypes: ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))  # noqa: E731
    error.add_note(f"[RoundPipe] the layers compute in {names(floating)} (param_dtype, env ROUNDPIPE_PARAM_DTYPE) but "
                   f"the inputs are {names(inputs)}: cast the floating inputs to the model's dtype (e.g. "
                   f"x.to(torch.{names(floating).split(', ')[0]})), or set param_dtype to the inputs' dtype.")


class Worker:
    def __init__(self, device: Device, store: HostStore, failure: FailureFlag, recompute: str,
                 base_seed: int, num_devices: int, trace: TraceRecorder | None = None,
                 schedules: dict[int, list[Task]] | None = None) -> None:
        self.device = device
        self.trace = trace
        device.record_to(trace)
        self.num_devices = num_devices
        self.failure = failure
        self.recompute = recompute
        self.base_seed = base_seed
        self.residency = ParamResidency(device, store, failure)
        self.saved_buffers = store.saved_input_buffers  # read back once, by a backward's `receive`
        self.grad_commits = GradCommits(device, store, failure, self.residency, trace)
        self.queue: queue.Queue[TaskJob | None] = queue.Queue()
        self._lookahead: collections.deque[TaskJob | None] = collections.deque()
        self.thread = threading.Thread(target=self._loop, name=f"roundpipe-{device}", daemon=True)
        # pass index -> schedule, for error reports; the dispatcher's, which it keeps to the recent passes
        self.schedules: dict[int, list[Task]] = schedules if schedules is not None else {}
        # end events of queued tasks ([Note: bounded run-ahead])
        self._task_ends: collections.deque = collections.deque()
        self._interpreters = {TaskKind.FORWARD: self._forward, TaskKind.FUSED: self._fused,
                              TaskKind.BACKWARD: self._backward_task}
        # Tasks put in the queue (by the caller) and tasks this thread is done with, span recorded: a task's `done`
        # may be set by its commit thread a moment before that (see `Dispatcher.wait_tasks_left_workers`).
        self.num_queued = 0
        self.num_left = 0

    def start(self) -> None:
        self.grad_commits.start()
        self.thread.start()

    def submit(self, job: TaskJob) -> None:
        """Queue `job` (on the caller's thread, in program order)."""
        self.num_queued += 1
        self.queue.put(job)

    def reseed(self, seed: int) -> None:
        """The base seed of the layers' RNG streams from the next task on (a checkpoint's, at a resume)."""
        self.base_seed = seed

    def stop(self) -> None:
        self.queue.put(None)
        self.grad_commits.stop()

    def release(self) -> None:
        """After `stop()` and the threads' end: let go of the queued jobs and the device's weights
        ([Note: memory freed at close])."""
        self._lookahead.clear()
        self._task_ends.clear()
        while True:
            try:
                self.queue.get_nowait()
            except queue.Empty:
                break
        self.residency.free_all()

    @property
    def threads(self) -> list[threading.Thread]:
        return [self.thread] + self.grad_commits.threads

    def _next_job(self) -> TaskJob | None:
        return self._lookahead.popleft() if self._lookahead else self.queue.get()

    def _peek_job(self, position: int = 0) -> TaskJob | None:
        """The queued job `position` places after the one being run, without taking it; None when not queued yet."""
        while len(self._lookahead) <= position:
            try:
                self._lookahead.append(self.queue.get_nowait())
            except queue.Empty:
                return None
        return self._lookahead[position]

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
                if self.failure.running:
                    committing = self._run(job)
            except BaseException as error:  # noqa: BLE001 - reported to the caller
                if isinstance(error, torch.cuda.OutOfMemoryError):
                    error = _explain_oom(error, job)
                _explain_dtype(error, job, self.residency.store)
                where = f"worker {self.device} running task {job.task} of pass {job.plan.index}"
                if self.failure.error is None and not isinstance(error, Aborted):  # Aborted: cancelled, not failed
                    logger.error("[%s] %s failed:\n%s", self.device, job.task,
                                 format_schedule(self.schedules.get(job.plan.index, []), self.num_devices,
                                                 job.schedule_index))
                self.failure.fail(error, where)
            finally:
                self.num_left += 1  # this thread's only write; the caller only reads it
                if not committing:
                    job.done.set(True)

    # ----------------------------------------------------------------- parameters

    def _params(self, job: TaskJob, with_grad: bool) -> TaskParams:
        """The task's parameters on the device, bound into the layer copies of its span (once per task)."""
        params = self.residency.take(job)
        upcoming = self._peek_job()
        following = self._peek_job(1) if upcoming is not None else None
        self.residency.prefetch(upcoming, params, following)  # overlaps this task's compute
        self.residency.bind(job, params, with_grad)
        return params

    def _run_layer(self, job: TaskJob, params: TaskParams, layer_index: int, microbatch: int,
                   args: tuple) -> tuple:
        self.residency.await_layer(params, layer_index)
        copy = self.residency.copy(layer_index)
        copy.set_training(job.plan.training)
        before = copy.state()  # [Note: stateless layers]
        profile = job.results.profile
        measure = _NO_PROFILE if profile is None else profile.measure(
            LayerRun.FORWARD_WITH_GRAPH if torch.is_grad_enabled() else LayerRun.FORWARD, layer_index, self.device,
            args)
        with measure, self.device.rng(stream_seed(self.base_seed, job.plan.rng_stream, layer_index, microbatch)):
            out = copy.module(*args)
        copy.check_stateless(before)
        return as_tuple(out, f"layer {layer_index} ({copy.kind})")

    def _send_next(self, job: TaskJob, tensors: tuple) -> Payload:
        """The task's outputs for the next task of the round: kept on this device for this worker; for another
        worker, through the host into the store's pooled blocks where that pool is on (its task's `receive` reads
        them back once: [Note: saved inputs in pooled blocks]); for the caller, in torch's page-locked cache (the
        caller keeps what it reads)."""
        if job.next_worker == self.device.index:
            return self.device.send(tensors, keep_on_device=True)
        pooled = self.saved_buffers if job.next_worker is not None else None
        return self.device.send(tensors, keep_on_device=False, buffers=pooled)

    # ----------------------------------------------------------------- task kinds

    def _run(self, job: TaskJob) -> bool:
        """Run one task; True when its commit thread will set `job.done`."""
        faults.point("worker.task")
        run = self._interpreters.get(job.task.kind)
        if run is None:
            raise ValueError(f"task {job.task} has kind {job.task.kind!r}, which no worker runs (known kinds: "
                             f"{', '.join(str(k) for k in self._interpreters)}).")
        self._bound_run_ahead()
        with self.device.compute(), maybe_span(self.trace, f"{self.device} host", str(job.task)):
            try:
                return self._run_traced(run, job)
            finally:
                self.residency.unbind()
                end = self.device.task_end_event()
                self._task_ends.append(end)
                self.residency.end_task(end)

    def _run_traced(self, run, job: TaskJob) -> bool:
        """`run(job)`, with a compute span in the trace when one is recorded on a device that times its kernels."""
        begin, finish = self.device.compute_span(str(job.task))
        begin()
        try:
            return run(job)
        finally:
            finish()

    def _bound_run_ahead(self) -> None:
        """[Note: bounded run-ahead]
        Nothing else stops the worker thread from queueing kernels many tasks ahead of the GPU, and every task it
        passes keeps memory alive until the GPU catches up (parameter copies and gradient buffers used on several
        streams are freed only then). Under a tight memory budget that filled a 24 GiB card whatever the plan, so
        a task starts only when the GPU has finished all but the last `MAX_TASKS_AHEAD` tasks (a host-side wait on
        an event of work already queued: it cannot deadlock, and a lead of that many tasks keeps the GPU fed)."""
        while len(self._task_ends) >= MAX_TASKS_AHEAD:
            self._task_ends.popleft().synchronize()

    def _save_input(self, job: TaskJob, layer: int, mb: int, h: tuple) -> None:
        """Keep a layer input for the backward's recomputation: on this device when the backward runs here and
        memory allows, else on the host."""
        keep = layer in job.keep_saved and self.device.can_keep(h, job.plan.keep_limit_bytes)
        job.results.save_input(layer, mb, self.device.send(h, keep_on_device=keep, buffers=self.saved_buffers))

    def _forward(self, job: TaskJob) -> bool:
        task, plan = job.task, job.plan
        params = self._params(job, with_grad=False)
        for j, mb in enumerate(range(*task.microbatches)):
            h = self.device.receive(job.inputs[j].take(self.failure))
            with torch.no_grad():
                for layer in task.span.layers:
                    if layer in plan.saved_layers:
                        self._save_input(job, layer, mb, h)
                    h = self._run_layer(job, params, layer, mb, h)
            job.outputs[j].set(self._send_next(job, h))
        self.residency.release(params)
        return False

    def _backward_layers(self, job: TaskJob, params: TaskParams, segments, grads: tuple,
                         commits: dict[int, list[tuple[int, int]]] | None) -> tuple:
        """Back-propagate `grads` through `segments` ((layer, inputs, outputs), top layer first, each cut from the
        next at its inputs); with `commits` (the last micro-batch), start each bucket's gradient download as soon
        as the backward has passed the bucket's lowest layer. Returns the gradients of the lowest inputs."""
        profile = job.results.profile
        for layer, inputs, outputs in segments:
            with profile.measure(LayerRun.BACKWARD, layer, self.device) if profile is not None else _NO_PROFILE:
                _backward(outputs, grads)
            grads = _input_grads(inputs)
            if commits and layer in commits:
                tickets = commits.pop(layer)
                self.grad_commits.commit(job, params, tickets, last=not commits)
        return grads

    def _forward_segments(self, job: TaskJob, params: TaskParams, layers: range, mb: int,
                          inputs: tuple, cut: bool = True) -> tuple[list[tuple[int, tuple, tuple]], tuple]:
        """Run `layers` with autograd, each layer's graph cut from the next at its inputs (so the backward can go
        one layer at a time), or with `cut` False as one graph, one segment. Returns the segments, top first, and
        the last outputs."""
        segments, h = [], inputs
        for layer in layers:
            x = h if layer == layers.start or not cut else _as_leaves(h, True)
            h = self._run_layer(job, params, layer, mb, x)
            if cut:
                segments.append((layer, x, h))
        if not cut:
            segments.append((layers.start, inputs, h))
        segments.reverse()
        return segments, h

    def _one_backward(self, job: TaskJob) -> bool:
        """[Note: one backward for device gradients]
        A fused task goes back one layer at a time so that each bucket's gradient download starts as soon as the
        backward has passed it and overlaps the layers below. A bucket whose optimizer state lives on a device
        has no download (its gradients are converted into a buffer on the device), so when every bucket the task
        computes gradients for is such a bucket, nothing overlaps and the cuts only cost: one autograd call per
        layer with its thread hand-over (the caller waits for the autograd thread, then for the GIL), an input
        leaf and its gradient per layer, and gradients for floating inputs that need none (rotary tables). The
        task then runs as one graph and one backward, and commits every bucket when it ends. The same sums: the
        gradients are bitwise those of the layer-by-layer backward, except where one tensor feeds two layers of
        the task (a tied embedding and head) and micro-batches accumulate, where its two uses are added before
        their sum joins the earlier micro-batches' (a rounding-level difference: 5e-17 in float64). A bucket at
        home on another device keeps the cuts (its copy across devices does overlap the layers below), and the
        measured pass keeps them too: it times each layer's backward."""
        if job.results.profile is not None:
            return False
        buckets, here = self.residency.store.buckets, self.device.device
        return all(buckets[b].tier.grads_stay_on(here) for b, _ in job.grad_tickets)  # [Note: state tiers]

    def _fused(self, job: TaskJob) -> bool:
        task, plan = job.task, job.plan
        params = self._params(job, with_grad=True)
        commits = self.grad_commits.schedule(job)
        cut = not self._one_backward(job)
        if not cut and commits:  # every bucket at the end, top first as the backward would have reached them
            commits = {task.span.start: self.grad_commits.in_backward_order(commits)}
        mbs = range(*task.microbatches)
        for j, mb in enumerate(mbs):
            inputs = _as_leaves(self.device.receive(job.inputs[j].take(self.failure)), task.span.start > 0)
            with torch.enable_grad():
                segments, h = self._forward_segments(job, params, task.span.layers, mb, inputs, cut)
                loss = self._loss(plan, h, mb)
                # The loss goes to the caller before its backward runs: the caller then queues the next pass while
                # the GPU still works on this one, so the next task's uploads start without a drained pipeline.
                job.results.set_loss(mb, self.device.send((loss.detach(),), keep_on_device=False))
                top = segments[0]
                if loss.requires_grad:
                    if plan.loss_weights[mb] == 0:
                        # Every label masked: its mean is NaN and its weight 0 ([Note: micro-batch loss weights]);
                        # the backward goes on from zero output gradients, so the gradients are exactly unchanged.
                        head = tuple(torch.zeros_like(o) if o.requires_grad else None for o in top[2])
                    else:
                        weighted = loss * plan.loss_weights[mb]
                        segments[0] = (top[0], top[1], (weighted,))
                        head = (torch.ones_like(weighted),)
                    grads = self._backward_layers(job, params, segments, head,
                                                  commits if j == len(mbs) - 1 else None)
                else:
                    grads = _input_grads(inputs)
            job.outputs[j].set(self._send_next(job, grads))
        self.residency.release(params)
        return self.grad_commits.finish(job, params, commits)

    def _loss(self, plan: PassPlan, outputs: tuple, mb: int) -> torch.Tensor:
        if plan.loss_fn is None:
            if len(outputs) != 1 or outputs[0].dim() != 0:
                raise TypeError(f"without loss_fn the last layer must return the loss as a 0-dim tensor; it returned "
                                f"shapes {[tuple(o.shape) for o in outputs]}. Pass loss_fn=... to forward_backward.")
            return outputs[0]
        labels = plan.labels[mb]
        if labels is not None:
            labels = self.device.receive(Payload(labels))
            labels = labels[0] if len(labels) == 1 else labels
        preds = outputs[0] if len(outputs) == 1 else outputs
        loss = plan.loss_fn(preds, labels) if labels is not None else plan.loss_fn(preds)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise TypeError(f"loss_fn must return a 0-dim tensor, got {type(loss).__name__} "
                            f"{tuple(getattr(loss, 'shape', ()))}.")
        return loss

    def _backward_task(self, job: TaskJob) -> bool:
        task = job.task
        params = self._params(job, with_grad=True)
        commits = self.grad_commits.schedule(job)
        needs_input_grad = task.span.start > 0
        mbs = range(*task.microbatches)
        for j, mb in enumerate(mbs):
            grads = self.device.receive(job.inputs[j].take(self.failure))
            last = commits if j == len(mbs) - 1 else None
            with torch.enable_grad():
                if self.recompute == "layer":
                    segments = (self._recompute_layer(job, params, layer, mb, needs_input_grad)
                                for layer in reversed(task.span.layers))
                else:
                    inputs = _as_leaves(self.device.receive(job.results.take_saved_input(task.span.start, mb)),
                                        needs_input_grad)
                    segments, _ = self._forward_segments(job, params, task.span.layers, mb, inputs)
                grads = self._backward_layers(job, params, segments, grads, last)
            job.outputs[j].set(self._send_next(job, grads if needs_input_grad else ()))
        self.residency.release(params)
        return self.grad_commits.finish(job, params, commits)

    def _recompute_layer(self, job: TaskJob, params: TaskParams, layer: int, mb: int,
                         needs_input_grad: bool) -> tuple[int, tuple, tuple]:
        saved = self.device.receive(job.results.take_saved_input(layer, mb))
        inputs = _as_leaves(saved, needs_input_grad or layer > job.task.span.start)
        return layer, inputs, self._run_layer(job, params, layer, mb, inputs)
