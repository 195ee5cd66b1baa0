"""A worker's device: the one interface the worker, the residency, the gradient commits and the profiler use.

`make_device(torch_device, index)` (`factory.py`) makes the device class for that kind of device, chosen once
(`device_class`): `CudaDevice` (`cuda_device.py`) on a GPU, `CpuDevice` (`cpu_device.py`) for a CPU worker. The
classes import this module, never the other way round. The transfer logic below is
written once, against streams and events ([Note: transfer engine]); a class supplies only the primitives (make a
stream, copy on it, hold a tensor for it, allocate page-locked host memory, time a kernel, seed the RNG), so the CPU
runs the same ordering logic as the GPU, with streams and events that are no-ops there, and
`stream_model.StreamModelDevice` runs it with streams as ordered queues that check CUDA's ordering rules.
"""

from __future__ import annotations

import abc
import contextlib
import os
import warnings
from collections.abc import Iterator

import torch

from ..common import faults
from .payload import NO_SPAN, Payload, WallTimer

UPLOAD_CAST_CHUNK = 1 << 25  # elements a host->device copy with a cast stages at a time (128 MiB of float32)
# Bytes of one parameter copy over PCIe ([Note: parameter uploads in chunks]): about 1.2 ms at 55 GB/s.
PARAM_UPLOAD_CHUNK_BYTES = 64 * 2**20
GRAD_DOWNLOAD_SLICE = 32 * 2**20  # elements per gradient copy: bounds the device-side dtype conversion's buffer


def use_expandable_segments() -> bool:
    """Turn on the CUDA caching allocator's expandable segments unless the user configured the allocator.

    The engine's tasks allocate differently sized stages, parameter sets and saved inputs in turn; with fixed-size
    segments a 24 GiB card lost 4 GiB to fragmentation and ran out of memory with 20 GiB allocated (Qwen3-4B on an
    H200 capped at 24 GiB). Expandable segments map memory into one growing range instead. The setting is
    process-wide, like `PYTORCH_CUDA_ALLOC_CONF`, which takes precedence when set."""
    if os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF"):
        return False
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    try:
        if setter is not None:
            setter("expandable_segments:True")
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    except (RuntimeError, AttributeError):  # an allocator without the option (e.g. a custom one)
        return False
    return True


def _squared_norm(flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[Note: device norms]
    The squared L2 norm of a bucket's gradient, computed on the device that produced it (a read of the gradient
    in fast device memory, queued on the compute stream before the download) and in the dtype the host keeps
    gradients in. A host pass over every gradient costs more than the CPU AdamW step itself (about 22 ms per 50M
    float32 values on the H200's host against 11 ms for the step), so gradient clipping needs the global norm
    without one: the bucket keeps the device's number while its gradient is exactly that download
    (`Bucket.commit`), and falls back to a host pass when gradients were summed on the host (accumulation, a
    weight shared by two tasks). Sliced like the download, so the dtype conversion never needs a bucket's worth
    of memory."""
    total = None
    for start in range(0, flat.numel(), GRAD_DOWNLOAD_SLICE):
        part = torch.linalg.vector_norm(flat[start:start + GRAD_DOWNLOAD_SLICE], dtype=dtype).square()
        total = part if total is None else total + part
    return total if total is not None else torch.zeros((), dtype=dtype, device=flat.device)


class Device(abc.ABC):
    """[Note: transfer engine]
    A worker has one compute stream and four copy streams: activation upload, activation download, parameter
    upload, gradient download (PCIe is full duplex, and parameters and gradients then never queue behind the
    activations on the critical path). Nothing blocks the worker thread on the GPU: every copy records an event,
    consumers wait on it on their own stream (or, on the CPU, when they read), and tensors used across streams are
    handed to the caching allocator (`_hold`, CUDA's `record_stream`) so their memory is not reused too early. A
    task's next task on the same worker takes its activations straight from the device (no host round trip).

    [Note: devices as classes]
    The ordering logic (which stream waits for which event, which copy records which event) is written once, here;
    a device class supplies the primitives. On a CPU worker the streams and events are no-ops and the copies are
    done when issued, so CI runs this same logic; `stream_model.StreamModelDevice` runs it with every copy queued on
    its stream until something waits for it, and checks the rules CUDA relies on (an event is recorded before it is
    waited for, the compute stream waits for an upload before a layer reads it, the host reads a download only after
    its event). Nothing outside the device classes asks which kind of device it is: callers ask for what they need
    (`records_kernel_time`, `tracks_memory`, ...). `make_device(torch_device, index)` (`factory.py`) makes the class
    `device_class` picks.
    """

    is_cuda = False  # the process needs CUDA's allocator and page-locked host memory (the engine's settings)
    records_kernel_time = False  # kernels are timed on the device (trace spans of streams, profiler timers)
    tracks_memory = False  # the device counts its allocated memory (the profiler's act/work bytes, metrics)

    def __init__(self, device: torch.device, index: int) -> None:
        self.device = torch.device(device)
        self.index = index
        self.compute_stream = self.act_in = self.act_out = self.param_in = self.grad_out = None
        self.trace = None  # a TraceRecorder: copies then get spans on their own stream's track

    def __str__(self) -> str:
        return f"d{self.index}({self.device})"

    def record_to(self, trace) -> None:
        """Record copies in `trace` (a TraceRecorder, or None), each on its own stream's track; told by the worker
        that owns the device, before its thread starts."""
        self.trace = trace

    # -------------------------------------------------------------- primitives a device class supplies

    @abc.abstractmethod
    def start_thread(self) -> None:
        """Called on the worker's own thread before it runs anything; the streams exist afterwards."""

    @abc.abstractmethod
    def _on_stream(self, stream) -> contextlib.AbstractContextManager:
        """A context in which work is queued on `stream`."""

    @abc.abstractmethod
    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of host `tensor` on the device, queued on the current stream."""

    @abc.abstractmethod
    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of device `tensor` in new page-locked host memory, queued on the current stream."""

    @abc.abstractmethod
    def _copy_to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue the copy of host `src` into device `dst` on the current stream."""

    @abc.abstractmethod
    def _copy_to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue the copy of device `src` into host `dst` (page-locked: an async-copy target) on the current
        stream, converting to `dst`'s dtype on the device."""

    @abc.abstractmethod
    def _copy_on_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue a device-side copy (with a cast) on the current stream."""

    @abc.abstractmethod
    def _page_locked_empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """New host memory an async copy may target."""

    @abc.abstractmethod
    def _hold(self, tensor: torch.Tensor, stream) -> None:
        """Keep `tensor`'s memory from reuse until `stream`'s queued work is done (`record_stream`)."""

    @abc.abstractmethod
    def rng(self, seed: int) -> contextlib.AbstractContextManager:
        """The layer run inside draws from the stream `seed`."""

    def _empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """New device memory (contents undefined), on the current stream."""
        return torch.empty(shape, dtype=dtype, device=self.device)

    def _fits(self, size: int, limit_bytes: int) -> bool:
        """Whether `size` more bytes keep the device's allocated memory under `limit_bytes`."""
        return True  # a device that counts no memory: the limit only switches the path (tests exercise both)

    def kernel_span(self, stream, track: str, name: str):
        """(begin, finish) callables recording a span of `stream`'s work named `name` on this device's `track` in
        the trace; no-ops unless the device `records_kernel_time` and a trace is recorded."""
        return NO_SPAN

    def timer(self):
        """A timer of the work queued from now to its `stop()` (`elapsed_s()` waits for it)."""
        return WallTimer()

    def upload_timer(self):
        """A timer of the weight uploads queued from now to its `stop()` (the profiler's upload rate)."""
        return WallTimer()

    def reset_peak_memory(self) -> None:  # noqa: B027 - nothing to reset on a device that counts no memory
        """Start a new peak of allocated memory (devices that `tracks_memory`)."""

    def allocated_bytes(self) -> int:
        """Memory the device has allocated now (0 on devices that do not `tracks_memory`)."""
        return 0

    def peak_allocated_bytes(self) -> int | None:
        """The most memory allocated since the last reset; None on devices that do not `tracks_memory`."""
        return None

    def total_memory_bytes(self) -> int | None:
        """The device's memory; None where there is no such limit (a CPU worker)."""
        return None

    # -------------------------------------------------------------- the logic written once

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        with self._on_stream(self.compute_stream):
            yield

    def compute_span(self, name: str):
        """(begin, finish) of a compute-stream span for a task ([Note: weight waits in the trace])."""
        return self.kernel_span(self.compute_stream, "compute", name)

    def task_end_event(self):
        """An event the compute stream reaches once everything queued on it so far is done
        ([Note: bounded run-ahead])."""
        return self.compute_stream.record_event()

    def _traced(self, stream, track: str, tensors):
        """(start, finish) callables bracketing a copy on `stream` with trace events (no-ops when not tracing)."""
        if self.trace is None or not self.records_kernel_time:
            return NO_SPAN
        size = sum(t.numel() * t.element_size() for t in tensors if t is not None) / 2**20
        return self.kernel_span(stream, track, f"{size:.1f} MiB")

    # -------------------------------------------------------------- host -> device

    def _upload(self, tensors, stream, after_event=None, track: str = "upload") -> tuple[list, list]:
        """Copies of `tensors` on the device and one copy event per tensor, so a consumer can start on the first
        tensor while the others are still in flight; the copies run in order on one stream, so the last event
        covers them all."""
        with self._on_stream(stream):
            if after_event is not None:
                stream.wait_event(after_event)
            begin, finish = self._traced(stream, track, tensors)
            begin()
            out, events = [], []
            for t in tensors:
                out.append(None if t is None else self._to_device(t))
                events.append(stream.record_event())
            finish()
            return out, events

    def _use(self, tensors, event) -> None:
        """Make the compute stream wait for an upload and own its tensors."""
        if event is None:
            return
        self.compute_stream.wait_event(event)
        for t in tensors:
            if t is not None:
                self._hold(t, self.compute_stream)

    def empty_params(self, hosts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Device buffers shaped like the host compute copies `hosts`, for `upload_params_into` (allocated on the
        parameter-upload stream, as the copies into them run there)."""
        with self._on_stream(self.param_in):
            return [self._empty(h.shape, h.dtype) for h in hosts]

    def retire_params(self, flats: list[torch.Tensor], end_event) -> None:
        """`flats` were read by the compute stream up to `end_event` and will be uploaded into again, after a wait
        for it ([Note: weight buffers reused]); a device that checks stream order records it."""
        return None  # nothing to record where the order is not checked

    def upload_params_into(self, flats: list[torch.Tensor], hosts: list[torch.Tensor]) -> list:
        """Start copying host buckets (compute copies, or optimizer copies in another dtype, cast on the device)
        into the device buffers `flats`; returns one copy event per bucket. Call `use_params` for a bucket before
        computing with it: a task's first layer can start as soon as its own bucket has landed. Buffers an earlier
        task read are waited for first, by `wait_before_uploads` ([Note: weight buffers reused])."""
        faults.point("transfer.upload")
        with self._on_stream(self.param_in):
            begin, finish = self._traced(self.param_in, "parameter upload", hosts)
            begin()
            events = []
            for flat, host in zip(flats, hosts):
                if host.device.type != "cpu":  # an optimizer copy kept on a device: cast there, nothing crosses PCIe
                    self._copy_between_devices(flat, host, UPLOAD_CAST_CHUNK)
                elif host.dtype == flat.dtype:
                    self._upload_in_chunks(flat, host)
                else:
                    self._upload_and_cast(flat, host)
                events.append(self.param_in.record_event())
            finish()
            return events

    def wait_before_uploads(self, after=()) -> None:
        """Make the uploads queued next wait, on the GPU, for the compute-stream `events` (buffers an earlier task
        read). The measured pass times its uploads after this: a wait for another task's compute is not upload
        time ([Note: upload rate without the buffer waits] in runtime/execution/residency.py)."""
        for event in dict.fromkeys(after):  # one wait per distinct event
            self.param_in.wait_event(event)

    def _upload_in_chunks(self, flat: torch.Tensor, host: torch.Tensor) -> None:
        """[Note: parameter uploads in chunks]
        Copy a host bucket into `flat` as copies of at most `PARAM_UPLOAD_CHUNK_BYTES` each, on the one stream
        (the same bytes, in order). An activation copy on its own stream waits for the host-to-device copy ahead of
        it on the copy engine: behind one bucket-sized copy it waited for all of it (a 0.3 MiB input of the
        backward's first recompute took 82 ms behind a 4.1 GiB upload on Qwen3-30B-A3B, 2026-12-05); between
        chunks it waits for one. Parameters are the low-priority transfer, activations the critical path."""
        if host.numel() * host.element_size() <= PARAM_UPLOAD_CHUNK_BYTES or not (
                host.is_contiguous() and flat.is_contiguous()):
            self._copy_to_device(flat, host)
            return
        host, target = host.view(-1), flat.view(-1)
        step = max(1, PARAM_UPLOAD_CHUNK_BYTES // host.element_size())
        for start in range(0, host.numel(), step):
            self._copy_to_device(target[start:start + step], host[start:start + step])

    def _upload_and_cast(self, flat: torch.Tensor, host: torch.Tensor) -> None:
        """Copy `host` to the device in its own dtype, then cast into `flat`, in chunks through one staging
        buffer (torch's own cross-device copy with a dtype change would cast on the host first)."""
        staging = self._empty(min(host.numel(), UPLOAD_CAST_CHUNK), host.dtype)
        for start in range(0, host.numel(), UPLOAD_CAST_CHUNK):
            part = host[start:start + UPLOAD_CAST_CHUNK]
            stage = staging[:part.numel()]
            self._copy_to_device(stage, part)
            self._copy_on_device(flat[start:start + part.numel()], stage)  # the next chunk's copy waits for this

    def _copy_between_devices(self, dst: torch.Tensor, src: torch.Tensor, slice_numel: int) -> None:
        """[Note: casts between two GPUs in slices]
        Copy the flat `src` into the flat `dst`, one of them on this device and the other on a bucket's home
        device ([Note: optimizer placement]), converting the dtype. On one device the cast is one kernel. Between
        two GPUs torch's copy with a cast goes through a temporary as large as what it copies, on one of the two
        GPUs (a float32 optimizer copy of 1.6 GB would take 1.6 GB beside the plan's stages), so it runs
        `slice_numel` elements at a time; the slices are the same bytes, in order, on the current stream."""
        if dst.device == src.device or dst.numel() <= slice_numel:
            self._copy_on_device(dst, src)
            return
        for start in range(0, src.numel(), slice_numel):
            self._copy_on_device(dst[start:start + slice_numel], src[start:start + slice_numel])

    def empty_grads_on(self, home: torch.device, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A buffer on `home` (a bucket's home device: [Note: optimizer placement]) that a gradient download may
        convert into, allocated for the gradient-download stream that writes it."""
        if torch.device(home) == self.device:
            with self._on_stream(self.grad_out):
                return self._empty(numel, dtype)
        return torch.empty(numel, dtype=dtype, device=home)

    def use_params(self, flats: list[torch.Tensor], event) -> None:
        self._use(flats, event)

    @property
    def traces_weight_waits(self) -> bool:
        return self.trace is not None and self.records_kernel_time

    def weights_wait(self, layer_index: int):
        """(begin, finish) callables bracketing, on the compute stream, the wait for a layer's parameters: its
        version being written (the host waits) and its upload landing (the stream waits). Traced on GPUs as a span
        of the `weights wait` track, which a compute span alone hides: the task's span covers its waits
        ([Note: weight waits in the trace] in `telemetry/report.py`). No-ops when not tracing."""
        if not self.traces_weight_waits:
            return NO_SPAN
        return self.kernel_span(self.compute_stream, "weights wait", f"L{layer_index}")

    def can_keep(self, tensors: tuple, limit_bytes: int) -> bool:
        """Whether `tensors` may stay on this device (instead of a host round trip) without the device's allocated
        memory passing `limit_bytes`."""
        if limit_bytes <= 0:
            return False
        return self._fits(sum(t.numel() * t.element_size() for t in tensors if t is not None), limit_bytes)

    def receive(self, payload: Payload) -> tuple:
        """The payload's tensors on this device, ready for the compute stream."""
        if payload.worker_index == self.index:
            return payload.tensors
        faults.point("transfer.upload")
        event, payload.event = payload.event, None
        out, events = self._upload(payload.tensors, self.act_in, after_event=event, track="activation upload")
        self._use(out, events[-1] if events else None)
        if payload.lease is not None and events:  # its blocks are reused once this upload has read them
            payload.lease.touched_by(events[-1])
        return tuple(out)

    # -------------------------------------------------------------- device -> host

    def _download(self, tensors, stream, track: str = "download", target=None) -> tuple[tuple, object]:
        """Copies of `tensors` in page-locked host memory and the event after them: new memory (`_to_host`), or
        `target(tensor)`'s (a pooled block: [Note: saved inputs in pooled blocks])."""
        stream.wait_stream(self.compute_stream)
        with self._on_stream(stream):
            begin, finish = self._traced(stream, track, tensors)
            begin()
            out = []
            for t in tensors:
                if t is None:
                    out.append(None)
                    continue
                if target is None:
                    out.append(self._to_host(t.detach()))
                else:
                    out.append(target(t))
                    self._copy_to_host(out[-1], t.detach())
                self._hold(t, stream)
            finish()
            return tuple(out), stream.record_event()

    def send(self, tensors: tuple, keep_on_device: bool, buffers=None) -> Payload:
        """Hand tensors to the next task: kept on this device for the same worker, else copied to the host; into
        blocks of `buffers` (a `SavedInputBuffers`) when given: a payload that one `receive` reads back and that
        nothing else keeps ([Note: saved inputs in pooled blocks])."""
        if keep_on_device:
            return Payload(tuple(None if t is None else t.detach() for t in tensors), None, self.index)
        faults.point("transfer.download")
        if buffers is None:
            host, event = self._download(tensors, self.act_out, track="activation download")
            return Payload(host, event)
        lease = buffers.lease()
        host, event = self._download(tensors, self.act_out, "activation download",
                                     target=lambda t: self._pooled_target(buffers, t, lease))
        lease.touched_by(event)  # until an upload reads them, the blocks wait for this download
        return Payload(host, event, lease=lease)

    def _pooled_target(self, buffers, like: torch.Tensor, lease) -> torch.Tensor:
        """Page-locked host memory for a copy of `like` from `buffers`."""
        return buffers.host_copy_target(like, lease)

    def download_grads_into(self, grads: list[torch.Tensor], outs: list[torch.Tensor]) -> Payload:
        """Copy each flat device gradient into the host buffer `outs[i]` (or, for a bucket kept on a device, the device
        buffer), converting to its dtype on the way (on the device, a slice at a time, so the converted copy never
        needs a whole bucket's worth of device memory).
        The payload's tensors are `outs` followed by one host tensor of their squared L2 norms, in `outs`' dtype,
        measured where the gradients are ([Note: device norms])."""
        faults.point("transfer.download")
        squares = torch.stack([_squared_norm(g.detach(), o.dtype) for g, o in zip(grads, outs)])
        stream = self.grad_out
        stream.wait_stream(self.compute_stream)
        with self._on_stream(stream):
            begin, finish = self._traced(stream, "gradient download", outs)
            begin()
            for grad, out in zip(grads, outs):
                flat = grad.detach()
                if out.device.type != "cpu":  # a bucket kept on a device ([Note: optimizer placement]): cast there
                    self._copy_between_devices(out, flat, GRAD_DOWNLOAD_SLICE)
                else:
                    for start in range(0, flat.numel(), GRAD_DOWNLOAD_SLICE):
                        end = start + GRAD_DOWNLOAD_SLICE
                        self._copy_to_host(out[start:end], flat[start:end])
                self._hold(flat, stream)
            host_squares = self._page_locked_empty(squares.shape, squares.dtype)
            self._copy_to_host(host_squares, squares)
            self._hold(squares, stream)
            finish()
            return Payload(tuple(outs) + (host_squares,), stream.record_event())
