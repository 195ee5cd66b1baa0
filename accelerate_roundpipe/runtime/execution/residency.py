"""Parameter residency on one device: a task's parameters uploaded, bound into the layer copies, then released.

The host buffers are read under read tickets ([Note: per-layer events]); each bucket's upload is issued as soon as
the version its task needs is written ([Note: uploads as versions land]), the next task's written buckets already
while the current task computes (`prefetch`), once the current task's own uploads are all issued
([Note: the running task's uploads first]).
"""

from __future__ import annotations

import contextlib
import math

import torch

from ..common.sync import FailureFlag
from ..devices.device import Device
from ..devices.payload import NO_SPAN
from ..state.host_store import Binding, HostStore
from .jobs import TaskJob
from .layer_copy import LayerCopy
from .weight_buffers import WeightBuffers

NO_TIMING = contextlib.nullcontext()  # uploads of a pass that is not measured


class TaskParams:
    """Parameters of one task on the device.

    `flats[b]` is bucket b's compute copy on the device, allocated when the task is taken and filled by uploads
    issued as the bucket's version is written ([Note: uploads as versions land]); `events[b]` is
    the copy event of an issued upload, waited for on the compute stream only when the first layer using the bucket
    runs (`pending`). For a task that computes gradients, every trainable parameter is a leaf view of its flat whose
    `.grad` is preset to a view of a zeroed flat `grads[b]`: autograd then accumulates each micro-batch's gradients
    in place into one flat buffer per bucket, ready to download as is (views that require grad on a flat that
    requires grad would instead cost a full-size zero tensor per parameter per backward). `tickets` are the read
    tickets not yet ended (held until the copies have read the host), `unissued` those whose upload is not issued
    yet, in ticket order (not a suffix: a written bucket is issued ahead of an earlier one still being stepped),
    `last_event` the copy event of the upload issued last (the copies run in issue order on one stream).
    `windows[b]` are the elements [start, stop) of bucket b that `flats[b]` holds: the whole bucket, or the rows the
    task's layers read ([Note: row windows]). `grad_uses[b]` says which of bucket b's parameters the task's backward
    reached ([Note: parameters without a gradient]).
    """

    __slots__ = ("flats", "windows", "events", "pending", "tickets", "unissued", "last_event", "grads", "grad_uses",
                 "newest", "profile", "reused_after", "contents", "unallocated")

    def __init__(self, flats: dict[int, torch.Tensor], windows: dict[int, tuple[int, int]],
                 tickets: list[tuple[int, int]], newest: bool = False, profile=None) -> None:
        self.flats = flats
        self.profile = profile  # the pass's LayerProfile while it is measured: its uploads are timed
        self.windows = windows
        self.newest = newest  # an evaluation pass reads the newest weights ([Note: looking changes nothing])
        self.tickets = list(tickets)
        self.unissued = list(tickets)
        self.last_event = None
        self.events: dict[int, object] = {}
        self.pending: set[int] = set()
        self.grads: dict[int, torch.Tensor] = {}
        # bucket -> (slot index, the `.grad` preset on a use of that slot, its version when preset), one per use
        self.grad_uses: dict[int, list[tuple[int, torch.Tensor, int]]] = {}
        # bucket -> the compute-stream event its reused buffer is free after ([Note: weight buffers reused])
        self.reused_after: dict[int, object] = {}
        # frozen bucket -> (window, read epoch, content generation) of what its flat holds once uploaded: a later
        # task asking for the same may share the flat ([Note: shared frozen weights])
        self.contents: dict[int, tuple] = {}
        # buckets of a partial look-ahead not given a flat yet, in ticket order: allocated when the task is taken
        # ([Note: shared frozen weights])
        self.unallocated: list[int] = []

    def used_slots(self, bucket_index: int) -> frozenset[int]:
        """The slots of `bucket_index` whose gradient the task's backward accumulated into, so far: a preset `.grad`
        that autograd added into in place has a new version ([Note: parameters without a gradient])."""
        return frozenset(slot for slot, grad, version in self.grad_uses.get(bucket_index, ())
                         if grad._version != version)

    def mark_issued(self, batch: list[tuple[int, int]], events: list) -> None:
        issued = set(batch)
        self.unissued = [ticket for ticket in self.unissued if ticket not in issued]
        for (bucket_index, _), event in zip(batch, events):
            self.events[bucket_index] = event
            if event is not None:
                self.pending.add(bucket_index)
                self.last_event = event


ViewSpec = tuple  # (bucket index, shape, stride, offset in the task's flat of that bucket, slot index)


class BindPlan:
    """[Note: bind plans]
    What binding a task's parameters into the layer copies of its span does, worked out once per span: the
    distinct parameter uses (`views`: one per bucket, slot and window, so tied uses share a tensor) with the shape,
    strides and offset of each inside its bucket's task flat (whose window is the span's, `HostStore.window`), and
    for each layer of the span which of them its copy's parameter uses get, in the copy's order (`layers`). A task
    then makes each view in one `as_strided` call on its flat: the same elements, shape and strides as the
    `flat[start:stop].view(shape)` it stands for (the strides are that view's own, taken once on a meta tensor), so
    the layers compute exactly as before. Per task, slicing and viewing every parameter and its gradient, with the
    Python to find them, cost about 11 us a parameter (135 a step on the 168M preset, the most host time the
    engine spent outside the layers); the plan leaves about 4."""

    __slots__ = ("views", "layers")

    def __init__(self, store: HostStore, layers: range) -> None:
        index_of: dict[tuple, int] = {}
        self.views: list[ViewSpec] = []
        self.layers: list[tuple[int, list[int]]] = []
        for layer in layers:
            uses = []
            for binding in store.layer_bindings[layer]:
                key = (binding.bucket_index, binding.slot_index, binding.window)
                if key not in index_of:
                    index_of[key] = len(self.views)
                    self.views.append(self._spec(store, layers, binding))
                uses.append(index_of[key])
            self.layers.append((layer, uses))

    @staticmethod
    def _spec(store: HostStore, layers: range, binding: Binding) -> ViewSpec:
        slot = store.buckets[binding.bucket_index].slots[binding.slot_index]
        start, stop = binding.window or (slot.offset, slot.offset + slot.numel)
        shape = binding.shape or slot.shape
        stride = torch.empty(stop - start, device="meta").view(shape).stride()  # the view's own strides
        return (binding.bucket_index, shape, stride, start - store.window(layers, binding.bucket_index)[0],
                binding.slot_index)


# [Note: idle buffers given back at the prefetch]; benchmarks/run.py --keep-idle-buffers turns it off (the buffers
# kept until they age out, as before) to measure the two beside each other
GIVE_BACK_IDLE_AT_PREFETCH = True
LOOK_AHEAD_PENDING_SHARE = 0.25  # of a prefetched task's parameter bytes, at most, still to upload for a look-ahead


class ParamResidency:
    """Which parameters one device holds: the layer copies, the uploads in flight and the task bound right now."""

    def __init__(self, device: Device, store: HostStore, failure: FailureFlag) -> None:
        self.device = device
        self.store = store
        self.failure = failure
        self.copies: dict[int, LayerCopy] = {}
        self._prefetched: dict[int, TaskParams] = {}  # id(job) -> its parameters, some uploads already in flight
        self._deferred: TaskJob | None = None  # the next job, prefetched once the running task's uploads are issued
        self._deferred_following: TaskJob | None = None  # the job after it ([Note: shared frozen weights])
        self._bound: range = range(0)  # layers whose copies hold the running task's tensors
        self._bind_plans: dict[tuple[int, int], BindPlan] = {}  # span -> its [Note: bind plans]
        self.buffers = WeightBuffers()  # [Note: weight buffers reused]
        self._running: TaskParams | None = None  # the parameters of the task the worker runs now
        self.shared = 0  # bucket flats a task took from another ([Note: shared frozen weights]; tests read it)
        self.looked_ahead = 0  # tasks prefetched while another prefetched one waited to run (tests read it)
        self.allocated_late = 0  # buckets a partial look-ahead left for the task's take (tests read it)

    def free_all(self) -> None:
        """The worker's thread stopped at the engine's close: let go of the layer copies, the parameters of tasks
        taken or prefetched and the idle weight buffers ([Note: memory freed at close])."""
        self.copies.clear()
        self._prefetched.clear()
        self._bind_plans.clear()
        self._deferred = self._deferred_following = self._running = None
        self.buffers = WeightBuffers()

    def copy(self, layer_index: int) -> LayerCopy:
        copy = self.copies.get(layer_index)
        if copy is None:
            copy = LayerCopy(self.store.layers[layer_index], layer_index, self.store.layer_bindings[layer_index],
                             self.device.device)
            self.copies[layer_index] = copy
        return copy

    def _allocate(self, job: TaskJob, room_bytes: float = math.inf) -> TaskParams:
        """`job`'s parameter flats: shared with a live task where it holds the same frozen content, else an idle
        buffer or new memory. With `room_bytes` (a look-ahead), the buckets in ticket order while they fit in it;
        the rest wait for `take` (`unallocated`)."""
        indices = [b for b, _ in job.read_tickets]
        windows = {b: self.store.window(job.task.span.layers, b) for b in indices}
        contents = self._contents(job, windows)
        shared = {}
        for b, content in contents.items():
            got = self._shared(b, content)
            if got is not None:  # a view of its own, so the holder's end sees the memory still in use and keeps
                flat, event = got  # it out of `buffers` until this task ends too ([Note: weight buffers reused])
                shared[b] = (flat.view(flat.shape), event)
        hosts = {b: self.store.buckets[b].compute[slice(*windows[b])] for b in indices if b not in shared}
        placed = []
        for b, host in hosts.items():  # a reused buffer takes room too: the look-ahead counted idle ones free
            room_bytes -= host.numel() * host.element_size()
            if room_bytes < 0:
                break
            placed.append(b)
        params = TaskParams({b: flat for b, (flat, _) in shared.items()}, windows, job.read_tickets,
                            newest=job.plan.reads_newest, profile=job.results.profile)
        params.contents = contents
        params.unallocated = [b for b in hosts if b not in placed]
        self._give_flats(params, {b: hosts[b] for b in placed})
        if shared:
            tickets = [(b, epoch) for b, epoch in job.read_tickets if b in shared]
            for b, epoch in tickets:  # written long ago (frozen): begins at once, ends as the holder's copy lands
                self.store.buckets[b].reads.begin_read(epoch, self.failure, f"{self.store.buckets[b]} (shared)")
            params.mark_issued(tickets, [shared[b][1] for b, _ in tickets])
            self.shared += len(tickets)
        return params

    def _give_flats(self, params: TaskParams, hosts: dict[int, torch.Tensor]) -> None:
        """Flats for the buckets of `hosts` (their host windows): idle buffers of the same size where there are,
        new memory for the rest."""
        reused = {b: got for b, host in hosts.items() if (got := self.buffers.take(host.numel(), host.dtype))}
        fresh = [b for b in hosts if b not in reused]
        params.flats.update(zip(fresh, self.device.empty_params([hosts[b] for b in fresh])))
        for b, (buffer, event) in reused.items():
            params.flats[b] = buffer if buffer.shape == hosts[b].shape else buffer.view(hosts[b].shape)
            params.reused_after[b] = event

    def _complete(self, params: TaskParams) -> None:
        """Flats for the buckets a partial look-ahead left out (the task is being taken)."""
        if params.unallocated:
            self.allocated_late += len(params.unallocated)
            hosts = {b: self.store.buckets[b].compute[slice(*params.windows[b])] for b in params.unallocated}
            params.unallocated = []
            self._give_flats(params, hosts)

    def _contents(self, job: TaskJob, windows: dict[int, tuple[int, int]]) -> dict[int, tuple]:
        """What each frozen bucket's flat of `job` will hold: (window, read epoch, content generation)."""
        buckets = self.store.buckets
        return {b: (windows[b], epoch, buckets[b].content_generation) for b, epoch in job.read_tickets
                if not buckets[b].trainable}

    def _shared(self, bucket_index: int, content: tuple):
        """[Note: shared frozen weights]
        (flat, copy event) of a task on this device, running or prefetched, whose flat of `bucket_index` holds
        `content` with its upload issued; None when none does.

        A frozen bucket holds the same values in every pass, so a task whose span repeats the running or prefetched
        one's (the next iteration's first forward stage after the last backward stage, the same layers) reads the
        flat that task uploaded instead of uploading it again: 4.1 GB a step on Qwen3-30B-A3B LoRA under a 24 GiB
        cap, where the last backward stage and the first forward stage both cover layers 0-3. That alone leaves the
        PCIe idle (the second forward stage's prefetch waits until the first stage runs), so a prefetched task with
        little left to upload (`_mostly_issued`: its uploads still to come would queue behind the look-ahead's)
        lets the worker prefetch the task after it too (`prefetch`), while the device's allocated memory stays
        under what the measured plan leaves a running task (`PassPlan.lookahead_limit_bytes`; the idle weight
        buffers count as free, and what the look-ahead does not take of them goes back to the allocator). Shared
        only with the same window, read epoch and content generation: a parameter the user changes in place counts
        its bucket's generation up at the next pass's launch (`FrozenEdits`), and that pass uploads it afresh."""
        for holder in (self._running, *self._prefetched.values()):
            if holder is None or holder.contents.get(bucket_index) != content:
                continue
            if bucket_index in holder.flats and bucket_index in holder.events:
                return holder.flats[bucket_index], holder.events[bucket_index]
        return None

    def _new_bytes(self, job: TaskJob) -> int:
        """Device memory `job`'s parameters would take besides what a live task shares with it."""
        windows = {b: self.store.window(job.task.span.layers, b) for b, _ in job.read_tickets}
        contents = self._contents(job, windows)
        sizes = [(stop - start, self.store.buckets[b].compute.dtype) for b, (start, stop) in windows.items()
                 if b not in contents or self._shared(b, contents[b]) is None]
        return sum(n * dtype.itemsize for n, dtype in sizes)

    def _issue(self, params: TaskParams, need: set[int] = frozenset()) -> None:
        """[Note: uploads as versions land]
        Issue `params`' uploads, each once its bucket's version is written: first every bucket already written, in
        ticket order, then (in the worker thread) waiting for those in `need`, one at a time, taking along whatever
        was written meanwhile. Uploading a whole task's buckets only once every version was written made the first
        layer of an iteration wait for the optimizer's very last write-back (with the exact step, the next forward
        started only after the whole host step, then waited for a 4 GB upload); issued as versions land, the copies
        overlap the step and the first layers compute while the optimizer still writes the layers above.

        A written bucket does not wait behind an earlier one that is not: the exact step writes the buckets of the
        last backward stage top-down as their gradients land, while the next forward reads them bottom-up, so
        stopping at the first unwritten bucket left the stream idle with the layers above it ready (Qwen3-30B-A3B
        LoRA under a 24 GiB cap, 2026-12-05: the first forward stage waited 165 ms for weights written 80 ms
        before). Each layer waits for its own buckets' copy events (`await_layer`), so the issue order is free."""
        buckets = self.store.buckets
        while params.unissued:
            batch = [(b, epoch) for b, epoch in params.unissued
                     if buckets[b].reads.version >= epoch and b not in params.unallocated]
            if not batch:
                waiting = [(b, epoch) for b, epoch in params.unissued if b in need and b not in params.unallocated]
                if not waiting:
                    return
                batch = waiting[:1]  # not written yet: its read waits for the optimizer's write
            for bucket_index, epoch in batch:
                buckets[bucket_index].reads.begin_read(epoch, self.failure,
                                                       f"{buckets[bucket_index]} version {epoch} for the next task")
            hosts = [buckets[b].current(params.newest)[slice(*params.windows[b])] for b, _ in batch]
            crossing = sum(h.numel() * h.element_size() for h in hosts if h.device.type == "cpu")
            timed = NO_TIMING
            # Timed on a measured pass only, and only from page-locked memory: the measured rate is that memory's
            # ([Note: compute copies locked where they cross]).
            if params.profile is not None and crossing and \
                    not any(self.store.uploads_pageable(b, h) for (b, _), h in zip(batch, hosts)):
                timed = params.profile.measure_upload(self.device, crossing)
            # [Note: upload rate without the buffer waits]
            # A reused buffer's upload waits on the GPU for the earlier task that read it
            # ([Note: weight buffers reused]). Inside the timer that wait counted as upload time: Qwen3-4B at 64
            # rows a step (forward stages of over a second) measured 1.3 GB/s on a 50 GB/s link, and the plan made
            # from it chose 64 micro-batches of one row with an 8-layer fused stage that ran out of memory. The wait
            # goes first.
            self.device.wait_before_uploads([params.reused_after.pop(b) for b, _ in batch
                                             if b in params.reused_after])
            with timed:
                events = self.device.upload_params_into([params.flats[b] for b, _ in batch], hosts)
            params.mark_issued(batch, events)
            if not any(b in need for b, _ in params.unissued):
                return

    def release(self, params: TaskParams) -> None:
        """End the task's read tickets once the copies have read the host buffers (they run in issue order on one
        stream: the last one issued covers them all). A bucket whose upload was never issued was never read."""
        if params.last_event is not None:
            params.last_event.synchronize()
        params.unissued = []
        for bucket_index, epoch in params.tickets:
            self.store.buckets[bucket_index].reads.end_read(epoch)
        params.tickets = []

    def release_landed(self, params: TaskParams) -> None:
        """[Note: early read release]
        Release the read tickets of the buckets whose copies have landed, without waiting for the others. A read
        ticket only has to outlive the copy out of the host buffer, not the task: held to the task's end, it made
        the next write-back of that bucket (and, behind it on the optimizer thread, every later step) wait for a
        whole pass. With the exact (sync) optimizer that serialised the step of iteration k behind iteration k's
        last task, so the next iteration found none of its weights ready. Each issued bucket's copy event is asked
        (the copies land in issue order, which is not ticket order: [Note: uploads as versions land])."""
        if not params.tickets:
            return
        unissued = {b for b, _ in params.unissued}
        kept = []
        for bucket_index, epoch in params.tickets:
            event = params.events.get(bucket_index)
            if bucket_index in unissued or (event is not None and not event.query()):
                kept.append((bucket_index, epoch))
            else:
                self.store.buckets[bucket_index].reads.end_read(epoch)
        params.tickets = kept

    def take(self, job: TaskJob) -> TaskParams:
        """`job`'s parameters on the device: the prefetched ones, else allocated now, with the uploads of every
        version already written issued ([Note: uploads as versions land])."""
        if self._deferred is job:
            self._deferred = self._deferred_following = None
        params = self._prefetched.pop(id(job), None) or self._allocate(job)
        self._complete(params)
        self._issue(params)
        self._running = params
        return params

    def prefetch(self, job: TaskJob | None, running: TaskParams | None = None,
                 following: TaskJob | None = None) -> None:
        """[Note: the running task's uploads first]
        Start the uploads of the next queued `job` that are already written (they overlap this task's compute);
        nothing is allocated for it while none of its buckets is written. The parameter copies run in issue order
        on one stream, so an upload issued for the next task delays every later one of the `running` task: with a
        bucket of the running task still being stepped (the exact step writes the last backward stage's buckets
        while the next forward starts on them), prefetching at once put the next stage's whole upload (8.7 GiB,
        170 ms on Qwen3-30B-A3B) ahead of the running task's own. So while some of the running task's buckets are
        not issued (`take` issued the written ones), the next job waits: `await_layer` prefetches it once the
        running task's last upload is issued. The next task cannot compute before the running one anyway.

        `following`, the job after `job`, is prefetched too when the device's memory allows it
        ([Note: shared frozen weights]).

        Then the idle weight buffers go back to the allocator ([Note: idle buffers given back at the prefetch])."""
        if running is not None and running.unissued:  # `take` has just issued what of it was written
            self._deferred, self._deferred_following = job, following
            if job is None and GIVE_BACK_IDLE_AT_PREFETCH:  # no prefetch will follow to give them back
                self.buffers.trim_to(self._idle_room(None))
            return
        self._deferred = self._deferred_following = None
        try:
            self._prefetch_next(job, following)
        finally:
            if GIVE_BACK_IDLE_AT_PREFETCH:
                self.buffers.trim_to(self._idle_room(job))

    def _idle_room(self, job: TaskJob | None) -> float:
        """Idle weight buffer bytes that may stay while the running task computes: what keeps the device's allocated
        memory under the plan's limit for a running task ([Note: idle buffers given back at the prefetch])."""
        limit = job.plan.lookahead_limit_bytes if job is not None else 0
        if limit <= 0 or not self.device.tracks_memory:
            return 0
        return max(0, limit - (self.device.allocated_bytes() - self.buffers.idle_bytes))

    def _prefetch_next(self, job: TaskJob | None, following: TaskJob | None) -> None:
        if job is None or not job.read_tickets:
            return
        if id(job) not in self._prefetched:
            if not any(self.store.buckets[b].reads.version >= epoch for b, epoch in job.read_tickets):
                return
            params = self._allocate(job)
            self._issue(params)
            self._prefetched[id(job)] = params
        room = self._look_ahead_room(following, behind=self._prefetched[id(job)]) if following is not None else 0
        if room > 0:  # the room counted the idle buffers free: what the look-ahead does not take goes back
            params = self._allocate(following, room)
            self.buffers.clear()
            self._issue(params)
            self._prefetched[id(following)] = params
            self.looked_ahead += 1

    def _look_ahead_room(self, job: TaskJob, behind: TaskParams) -> float:
        """Bytes of device memory `job`, behind the prefetched `behind`, may take now for its parameters (0: not
        now): `behind` has little left to upload (`_mostly_issued`), some of `job`'s are written, and the device's
        allocated memory stays under what the plan leaves a running task, the idle weight buffers counted free (the
        look-ahead takes what it can of them and gives the rest back). When not all of `job`'s new bytes fit, its
        first buckets in ticket order do: a partial look-ahead, completed when it is taken."""
        limit = job.plan.lookahead_limit_bytes
        if id(job) in self._prefetched or not job.read_tickets:
            return 0
        new, room = 0, 0
        if limit <= 0:
            verdict = "no limit"
        elif not self._mostly_issued(behind):
            verdict = "the next task still uploading"
        elif not any(self.store.buckets[b].reads.version >= epoch for b, epoch in job.read_tickets):
            verdict = "nothing written"
        else:
            new = self._new_bytes(job)
            room = limit - self.device.allocated_bytes() + self.buffers.idle_bytes \
                if self.device.tracks_memory else math.inf
            room = max(0, room)
            verdict = "taken" if room >= new else "partly taken" if room > 0 else "not taken"
        trace = self.device.trace
        if trace is not None:  # why a look-ahead was or was not taken, on the trace's own track
            with trace.span(f"{self.device} look-ahead", f"{job.task}: {verdict}",
                            allocated=self.device.allocated_bytes(), new=new, idle=self.buffers.idle_bytes,
                            limit=limit, room=room if room != math.inf else -1):
                pass
        return room

    def _mostly_issued(self, params: TaskParams) -> bool:
        """Whether at most `LOOK_AHEAD_PENDING_SHARE` of `params`' bytes are still to be uploaded: their copies
        will queue behind a look-ahead's on the one stream ([Note: shared frozen weights]). A full fine-tune's next
        forward stage, all of it being stepped, is not; a LoRA one whose frozen flats are shared is."""
        def nbytes(b: int) -> int:
            start, stop = params.windows[b]
            return (stop - start) * self.store.buckets[b].compute.element_size()

        pending = sum(nbytes(b) for b, _ in params.unissued)
        return pending <= LOOK_AHEAD_PENDING_SHARE * sum(nbytes(b) for b in params.windows)

    def bind(self, job: TaskJob, params: TaskParams, with_grad: bool) -> None:
        """Bind `params` into the layer copies of `job`'s span (once per task), with gradient buffers if asked."""
        if with_grad:
            for bucket_index, flat in params.flats.items():
                if self.store.buckets[bucket_index].trainable:
                    params.grads[bucket_index] = torch.zeros_like(flat)
        plan = self._bind_plan(job.task.span.layers)
        tensors = [self._view(params, view) for view in plan.views]
        for layer, uses in plan.layers:
            self.copy(layer).bind_tensors([tensors[i] for i in uses])
        self._bound = job.task.span.layers

    def _bind_plan(self, layers: range) -> BindPlan:
        """The views a task over `layers` binds, worked out once per span (the bindings and windows never change)."""
        key = (layers.start, layers.stop)
        plan = self._bind_plans.get(key)
        if plan is None:
            plan = self._bind_plans[key] = BindPlan(self.store, layers)
        return plan

    @staticmethod
    def _view(params: TaskParams, view: ViewSpec) -> torch.Tensor:
        """One tensor per parameter use (tied uses share it): a view of the task's flat, a leaf whose `.grad` is
        preset to the same elements of its gradient flat, as a tensor with a version counter of its own
        ([Note: parameters without a gradient])."""
        bucket_index, shape, stride, offset, slot_index = view
        flat = params.flats[bucket_index]
        tensor = flat.as_strided(shape, stride, flat.storage_offset() + offset)
        grad = params.grads.get(bucket_index)
        if grad is not None:
            tensor.requires_grad_(True)
            # `set_`, not a view: a view shares its base's version counter, so every parameter of the bucket would
            # seem reached as soon as one was.
            preset = grad.new_empty(0).set_(grad.untyped_storage(), grad.storage_offset() + offset, shape, stride)
            tensor.grad = preset
            params.grad_uses.setdefault(bucket_index, []).append((slot_index, preset, preset._version))
        return tensor

    def await_layer(self, params: TaskParams, layer_index: int) -> None:
        """Make the compute stream wait for the buckets of `layer_index`, issuing their uploads first if they are
        not issued yet (waiting for their versions: [Note: uploads as versions land])."""
        self.release_landed(params)  # [Note: early read release]
        if not params.pending and not params.unissued:
            return
        needed = self.store.layer_buckets[layer_index]
        waits = self.device.traces_weight_waits and (
            any(b in params.pending for b in needed) or any(b in needed for b, _ in params.unissued))
        begin, finish = self.device.weights_wait(layer_index) if waits else NO_SPAN
        begin()
        if params.unissued:
            self._issue(params, need={b for b, _ in params.unissued if b in needed})
            if not params.unissued and self._deferred is not None:
                # the deferred prefetch ([Note: the running task's uploads first])
                self.prefetch(self._deferred, following=self._deferred_following)
        for bucket_index in needed:
            if bucket_index in params.pending:
                params.pending.discard(bucket_index)
                self.device.use_params([params.flats[bucket_index]], params.events[bucket_index])
        finish()

    def unbind(self) -> None:
        """Unbind the running task's layer copies (once: before its last commit, else when it ends)."""
        for layer in self._bound:
            self.copy(layer).unbind()
        self._bound = range(0)

    def end_task(self, end_event) -> None:
        """The running task has queued its last kernel (`end_event` follows it on the compute stream): its
        parameter buffers go back for later tasks ([Note: weight buffers reused]). After `unbind`."""
        params, self._running = self._running, None
        if params is None:
            return
        flats = [flat if flat._base is None else flat._base for flat in params.flats.values()]
        params.flats = {}
        self.device.retire_params(flats, end_event)
        self.buffers.give(flats, end_event)
