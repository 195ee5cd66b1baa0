"""Dispatch: the device workers, where the round-robin stands, and one pass's tasks enqueued with their tickets.

All tickets of [Note: per-layer events] are reserved here, on the caller's thread, in program order: this is what
makes the results independent of thread timing.
"""

from __future__ import annotations

import time

from ...config import RoundPipeConfig
from ...plan.lowering import lower_schedule, task_links
from ...plan.partition import Partition
from ...plan.schedule import Mode, Task, TaskKind, build_schedule
from ...telemetry.trace import TraceRecorder
from ..common import faults
from ..common.sync import FailureFlag, Future
from ..devices.device import Device
from ..devices.payload import Payload
from ..state.host_store import HostStore
from .jobs import PassPlan, PassResults, TaskJob
from .measured_plan import MeasuredPlan
from .worker import Worker

_KEEP_SCHEDULES = 4  # recent passes whose schedules the workers keep for their error reports


class Dispatcher:
    """Sends the tasks of each pass to the workers of their devices, starting each pass on the device after the one
    that ended the previous pass."""

    def __init__(self, config: RoundPipeConfig, devices: list[Device], store: HostStore, failure: FailureFlag,
                 plan: MeasuredPlan, trace: TraceRecorder | None) -> None:
        self.config, self.devices, self.store, self.failure = config, devices, store, failure
        self.plan = plan  # decides which saved inputs may stay on the device ([Note: saved inputs])
        self.trace = trace
        self.workers: list[Worker] | None = None  # started on first use
        self.next_device = 0
        self._inflight: list[Future] = []  # `done` of every task not yet waited for
        # Each pass not yet seen ended: its results and its tasks' `done` ([Note: a pass's plan and results]).
        self._passes: list[tuple[PassResults, list[Future]]] = []
        self._schedules: dict[int, list[Task]] = {}  # pass index -> schedule, for the workers' error reports

    def start_workers(self, seed: int) -> bool:
        """Start the workers unless they run already; True when they were started now."""
        if self.workers is not None:
            return False
        self.workers = [Worker(d, self.store, self.failure, self.config.resolved_recompute, seed, len(self.devices),
                               self.trace, self._schedules) for d in self.devices]
        for worker in self.workers:
            worker.start()
        return True

    def reseed(self, seed: int) -> None:
        for worker in self.workers or []:
            worker.reseed(seed)

    def resume_at(self, next_device: int) -> None:
        """The next pass starts on device `next_device` (modulo the device count), as a checkpoint recorded."""
        self.next_device = next_device % len(self.devices)

    def schedule(self, partition: Partition, num_mb: int, mode: Mode) -> list[Task]:
        """The tasks of the next pass of `num_mb` micro-batches."""
        per_round = self.config.microbatches_per_round or num_mb
        return build_schedule(partition, num_mb, per_round, len(self.devices), self.next_device, mode)

    def forget_finished(self) -> None:
        self._inflight = [f for f in self._inflight if not f.done]
        self._check_ended_passes()

    def wait_inflight(self) -> None:
        for done in self._inflight:
            done.get(self.failure)
        self._inflight.clear()
        self._check_ended_passes()

    def _check_ended_passes(self) -> None:
        """Check the results of every pass whose tasks are all done empty ([Note: a pass's plan and results]); on
        the caller's thread, after it took the losses and outputs."""
        ended = [results for results, done in self._passes if all(f.done for f in done)]
        self._passes = [(results, done) for results, done in self._passes if not all(f.done for f in done)]
        if not self.failure.running:
            return  # a failed or cancelled task sets `done` having left its work undone: nothing to check
        for results in ended:
            results.check_drained()

    def layer_copies(self) -> list[tuple[int, object]]:
        """(layer index, module) of every device's copies of the layers ([Note: adapter switches])."""
        return [(index, copy.module) for worker in self.workers or []
                for index, copy in worker.residency.copies.items()]

    def wait_tasks_left_workers(self, timeout_s: float = 10.0) -> None:
        """After `wait_inflight`: wait until every worker thread is past its last task, so its trace span is
        recorded (a task's commit thread may set `done` while the worker still closes the span)."""
        deadline = time.monotonic() + timeout_s
        for worker in self.workers or []:
            while worker.num_left < worker.num_queued and worker.thread.is_alive() and time.monotonic() < deadline:
                time.sleep(0.001)

    def _saved_input_readers(self, tasks: list[Task], mode: Mode) -> dict[tuple[int, int], int]:
        """(round, layer) -> the device whose task will read that layer's saved input ([Note: saved inputs]).
        A forward-only pass (`model(...)`) does not know its backward schedule yet: with one device it is that one."""
        if mode is Mode.TRAIN:
            return {(t.round_index, layer): t.device_index for t in tasks if t.kind is not TaskKind.FORWARD
                    for layer in t.span.layers}
        if len(self.devices) == 1:
            return {(t.round_index, layer): 0 for t in tasks for layer in t.span.layers}
        return {}

    def enqueue(self, tasks: list[Task], plan: PassPlan, results: PassResults,
                first_inputs: list[tuple]) -> list[TaskJob]:
        with self.failure.reserving(f"pass {plan.index}"):  # [Note: interrupted reservations]
            return self._enqueue(tasks, plan, results, first_inputs)

    def _enqueue(self, tasks: list[Task], plan: PassPlan, results: PassResults,
                 first_inputs: list[tuple]) -> list[TaskJob]:
        self._schedules[plan.index] = tasks
        for old in [k for k in self._schedules if k <= plan.index - _KEEP_SCHEDULES]:
            del self._schedules[old]
        store = self.store
        reader = self._saved_input_readers(tasks, plan.mode)
        # Which task's outputs feed each task, and where its outputs go: the lowered schedule says it, not this loop
        # ([Note: schedule lowering]).
        links = task_links(lower_schedule(tasks))
        outputs_of: list[list[Future]] = []  # per task, in schedule order
        jobs = []
        for index, task in enumerate(tasks):
            mbs = range(*task.microbatches)
            link = links[index]
            if link.source is None:  # the round's first task: its inputs are the caller's
                inputs = [Future() for _ in mbs]
                for future, mb in zip(inputs, mbs):
                    future.set(Payload(first_inputs[mb]))
            else:
                inputs = outputs_of[link.source]
            outputs = [Future(f"output of {task} micro-batch {mb}") for mb in mbs]
            buckets = store.buckets_of_layers(task.span.layers)
            reads = [(b, store.buckets[b].reads.reserve_read()) for b in buckets]
            grads = [(b, store.buckets[b].grads.reserve()) for b in buckets
                     if task.needs_grad and store.buckets[b].trainable]
            faults.point("dispatch.enqueue")  # on the caller's thread, between reservation and submission
            job = TaskJob(task, plan, results, inputs, outputs, reads, grads, index, link.send_to,
                          keep_saved=frozenset(layer for layer in task.span.layers
                                               if reader.get((task.round_index, layer)) == task.device_index))
            outputs_of.append(outputs)
            jobs.append(job)
            self._inflight.append(job.done)
            self.workers[task.device_index].submit(job)
        last_of_rounds = sorted((i for i, link in enumerate(links) if link.send_to is None),
                                key=lambda i: tasks[i].round_index)  # the tasks whose outputs go to the caller
        if plan.mode is Mode.FORWARD:  # a backward's last tasks give the gradients of the inputs, which none reads
            results.expect_outputs([f for i in last_of_rounds for f in outputs_of[i]])
        self._passes.append((results, [job.done for job in jobs]))
        self.next_device = (tasks[-1].device_index + 1) % len(self.devices)
        return jobs
