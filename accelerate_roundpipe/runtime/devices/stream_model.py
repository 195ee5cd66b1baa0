"""A CPU device that keeps CUDA's ordering rules: streams as ordered queues, so CI checks the GPU path's ordering.

[Note: stream model]
`CpuDevice` runs `Device`'s transfer logic with work done when it is issued, so a missing wait costs nothing on the
CPU and only breaks on a GPU. `StreamModelDevice` runs the same logic as a GPU would at its slowest: every copy is
queued on its stream and runs only when something needs it (a stream or the host waiting for an event after it),
in issue order, and its destination holds poison (NaN, or the dtype's minimum) until then. The compute stream runs
its work when it is issued (the worker thread's own timeline). It enforces, raising `StreamOrderError` in the
thread that breaks them (the engine reports it to the caller like any worker failure):
- an event is recorded before anything waits for it (CUDA silently does not wait on an unrecorded event);
- the compute stream reads no upload's destination before it waited for the upload's event (checked on every op the
  compute stream runs, views and allocations aside);
- an asynchronous copy to the host targets page-locked memory (`_page_locked_empty`, a copy `_to_host` allocates,
  or the gradient pool's buffers, which the engine page-locks whenever a GPU is used).
A host read of a download before its event (`Payload.host`) reads the poison, and the gradients, norms or losses turn
NaN. A copy into a buffer handed from one task to a later one (`retire_params`: [Note: weight buffers reused]) must
be issued on a stream that waited for the compute stream past its last read of that buffer. Not modelled: the
caching allocator's reuse (`_hold`, CUDA's `record_stream`: Python keeps a queued copy's tensors alive). Tests make
every CPU worker one with `monkeypatch.setattr(runtime.devices.factory, "cpu_device_class", StreamModelDevice)`
(`tests/test_stream_model.py`).
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .cpu_device import CpuDevice
from .payload import Payload

# One lock for every modelled stream: running one stream's queue may run another's (a wait for its event).
_LOCK = threading.RLock()
_local = threading.local()  # per thread: `stream` (the current stream), `running` (queued work being run)


class StreamOrderError(RuntimeError):
    """A stream operation that CUDA would let through with a wrong result."""


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _poison(tensor: torch.Tensor) -> None:
    """What a copy's destination holds until the copy runs: values no correct computation passes on unnoticed."""
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.fill_(float("nan"))
    elif tensor.dtype != torch.bool:
        tensor.fill_(torch.iinfo(tensor.dtype).min)


class ModelEvent:
    """A point in a modelled stream's queue: done once the stream ran everything issued before it."""

    __slots__ = ("stream", "position")

    def __init__(self) -> None:
        self.stream: ModelStream | None = None
        self.position = 0

    def record(self, stream: ModelStream) -> None:
        with _LOCK:
            if stream.eager:  # a mark of its own, so work issued before it and after it have distinct positions
                stream.issued += 1
                stream.done += 1
            self.stream, self.position = stream, stream.issued
            stream.device.log.append((stream.name, "record event"))

    def _recorded(self, who: str) -> ModelStream:
        if self.stream is None:
            raise StreamOrderError(f"{who} waits for an event that was never recorded (CUDA would not wait at all)")
        return self.stream

    def synchronize(self) -> None:
        stream = self._recorded("the host")
        stream.device.log.append(("host", f"wait for {stream.name}"))
        stream.run_to(self.position)

    def query(self) -> bool:
        return self.stream is not None and self.stream.done >= self.position


class ModelStream:
    """An ordered queue of work on one device; the compute stream (`eager`) runs its work when it is issued."""

    def __init__(self, device: StreamModelDevice, name: str, eager: bool = False) -> None:
        self.device, self.name, self.eager = device, name, eager
        self.queue: collections.deque = collections.deque()
        self.issued = self.done = 0
        self.compute_waited = -1  # the furthest position of its device's compute stream this stream waited for

    def __repr__(self) -> str:
        return f"{self.device} {self.name}"

    def enqueue(self, work, what: str) -> None:
        with _LOCK:
            self.device.log.append((self.name, what))
            self.issued += 1
            self.queue.append(work)
            if self.eager:
                self.run_to(self.issued)

    def run_to(self, position: int) -> None:
        """Run the queued work issued before `position`, in order."""
        with _LOCK:
            _local.running = getattr(_local, "running", 0) + 1
            try:
                while self.done < position:
                    work = self.queue.popleft()
                    self.done += 1
                    work()
            finally:
                _local.running -= 1

    def record_event(self) -> ModelEvent:
        event = ModelEvent()
        event.record(self)
        return event

    def wait_event(self, event) -> None:
        if not isinstance(event, ModelEvent):
            raise StreamOrderError(f"{self} waits for {event!r}, which is not an event of a stream")
        source = event._recorded(str(self))
        what = f"wait for {source.name}" + ("" if source.device is self.device else f" of {source.device}")
        if source is self.device.compute_stream:
            self.compute_waited = max(self.compute_waited, event.position)
        self.enqueue(lambda: source.run_to(event.position), what)

    def wait_stream(self, stream: ModelStream) -> None:
        self.wait_event(stream.record_event())


class _ComputeReads(TorchDispatchMode):
    """Refuses an op of the compute stream that reads a copy destination whose event it has not waited for."""

    _NOT_READS = frozenset({"empty_like", "zeros_like", "ones_like", "full_like", "detach", "alias", "lift_fresh",
                            "_local_scalar_dense"})

    def __init__(self, device: StreamModelDevice) -> None:
        super().__init__()
        self.device = device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = self.device
        reads = not getattr(func, "is_view", False) and getattr(func, "_opname", None) not in self._NOT_READS
        if reads and device.reusable and getattr(_local, "stream", None) is device.compute_stream:
            for leaf in tree_leaves((args, kwargs)):
                if isinstance(leaf, torch.Tensor) and _storage(leaf) in device.reusable:
                    device.compute_read_at[_storage(leaf)] = device.compute_stream.issued
        if (not getattr(_local, "running", 0) and getattr(_local, "stream", None) is device.compute_stream
                and device.in_flight and not getattr(func, "is_view", False)
                and getattr(func, "_opname", None) not in self._NOT_READS):
            for leaf in tree_leaves((args, kwargs)):
                if isinstance(leaf, torch.Tensor) and device.in_flight.get(_storage(leaf)):
                    raise StreamOrderError(
                        f"{device}: the compute stream runs {func} on a copy still in flight: it must wait for the "
                        f"copy's event first (`Device._use`)")
        return func(*args, **kwargs)


class StreamModelDevice(CpuDevice):
    """A CPU worker whose streams are ordered queues and whose events are positions in them ([Note: stream model])."""

    def __init__(self, device: torch.device, index: int) -> None:
        self.log: list[tuple[str, str]] = []
        self.in_flight: dict[int, int] = {}  # storage -> copies into it not run yet
        # Buffers handed from one task to a later one ([Note: weight buffers reused]) and the compute stream's
        # position at its last read of each; forgotten when memory at the same address is allocated anew (the
        # buffer was freed), so nothing here keeps a buffer alive
        self.reusable: set[int] = set()
        self.compute_read_at: dict[int, int] = {}
        self._page_locked: set[int] = set()
        super().__init__(device, index)

    def _new_stream(self, name: str) -> ModelStream:
        return ModelStream(self, name, eager=name == "compute")

    @contextlib.contextmanager
    def _on_stream(self, stream: ModelStream) -> Iterator[None]:
        outer = getattr(_local, "stream", None)
        _local.stream = stream
        try:
            yield
        finally:
            _local.stream = outer

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        with self._on_stream(self.compute_stream), _ComputeReads(self):
            yield

    def _current(self) -> ModelStream:
        stream = getattr(_local, "stream", None)
        if not isinstance(stream, ModelStream) or stream.device is not self:
            raise StreamOrderError(f"{self}: a copy issued outside any of this device's streams")
        return stream

    def retire_params(self, flats: list[torch.Tensor], end_event) -> None:
        for flat in flats:
            key = _storage(flat)
            self.reusable.add(key)
            self.compute_read_at[key] = end_event.position - 1  # the task's reads came before its end event

    def _queue_copy(self, dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
        stream, key = self._current(), _storage(dst)
        read_at = self.compute_read_at.get(key)
        if read_at is not None and stream is not self.compute_stream and stream.compute_waited <= read_at:
            raise StreamOrderError(
                f"{self}: {what} on {stream.name} overwrites memory the compute stream read, without waiting for "
                f"the compute stream past that read (a reused buffer: [Note: weight buffers reused])")
        with _LOCK:
            if not self.in_flight.get(key):  # not while an earlier copy on the stream still uses it
                _local.running = getattr(_local, "running", 0) + 1
                try:
                    with torch.no_grad():
                        _poison(dst)
                finally:
                    _local.running -= 1
            self.in_flight[key] = self.in_flight.get(key, 0) + 1

        def run() -> None:
            with torch.no_grad():  # a copy, as on the GPU, whichever thread runs it
                dst.copy_(src)
            self.in_flight[key] -= 1
            if not self.in_flight[key]:
                del self.in_flight[key]

        stream.enqueue(run, what)

    def _fresh(self, tensor: torch.Tensor) -> torch.Tensor:
        """New memory: whatever buffer lived at its address before is gone."""
        key = _storage(tensor)
        self.reusable.discard(key)
        self.compute_read_at.pop(key, None)
        return tensor

    def _empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return self._fresh(super()._empty(shape, dtype))

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        out = self._fresh(torch.empty_like(tensor))
        self._queue_copy(out, tensor, "copy to device")
        return out

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        out = self._page_locked_empty(tensor.shape, tensor.dtype)
        self._copy_to_host(out, tensor)
        return out

    def _copy_to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._queue_copy(dst, src, "copy to device")

    def _copy_to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if _storage(dst) not in self._page_locked:
            raise StreamOrderError(f"{self}: an asynchronous copy to the host into memory that is not page-locked "
                                   f"(allocate it with `_page_locked_empty`)")
        self._queue_copy(dst, src, "copy to host")

    def _copy_on_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._queue_copy(dst, src, "copy on device")

    def _page_locked_empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        out = self._fresh(torch.empty(shape, dtype=dtype))
        self._page_locked.add(_storage(out))
        return out

    def _pooled_target(self, buffers, like: torch.Tensor, lease) -> torch.Tensor:
        out = self._fresh(super()._pooled_target(buffers, like, lease))  # a pool block: never a weight buffer
        self._page_locked.add(_storage(out))  # the store's blocks, page-locked on GPUs
        return out

    def _hold(self, tensor: torch.Tensor, stream: ModelStream) -> None:
        stream.device.log.append((stream.name, "hold"))

    def download_grads_into(self, grads: list[torch.Tensor], outs: list[torch.Tensor]) -> Payload:
        self._page_locked.update(_storage(out) for out in outs)  # the gradient pool, pinned on GPUs
        return super().download_grads_into(grads, outs)
