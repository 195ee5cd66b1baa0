"""A worker's device: how tensors get on and off it, and its RNG streams.

A CPU "device" is a worker thread with its own copies: uploads and downloads clone, exactly as a GPU would copy,
so the scheduler, the event protocol and the optimizer are exercised unchanged without a GPU.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections.abc import Iterator

import torch

from . import faults
from .cpu_rng import StreamRandom

# Workers on the same device (every CPU worker, or two workers given the same GPU) share that device's generator;
# seeding it for a layer and launching the layer must not interleave with another worker doing the same.
_RNG_LOCKS: dict[str, threading.Lock] = {}
_RNG_LOCKS_GUARD = threading.Lock()


UPLOAD_CAST_CHUNK = 1 << 25  # elements a host->device copy with a cast stages at a time (128 MiB of float32)


def _rng_lock(device: torch.device) -> threading.Lock:
    with _RNG_LOCKS_GUARD:
        return _RNG_LOCKS.setdefault(str(device), threading.Lock())


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


def stream_seed(base_seed: int, pass_index: int, layer_index: int, microbatch_index: int) -> int:
    """The RNG seed of one layer on one micro-batch of one pass: the forward and its recomputation draw the same
    masks whatever device or thread runs them.

    [Note: RNG streams of passes]
    `pass_index` is the pass's `rng_stream`, not its pass number: training passes (the module in training mode)
    count 0, 1, 2, ... on their own and evaluation passes count -1, -2, ... apart, so an evaluation forward between
    training steps changes no later dropout mask, as in plain PyTorch, where an eval-mode forward draws nothing.
    A training-mode forward without gradients (generation in training mode) counts as a training pass: in plain
    PyTorch its draws move the generator too. Both counts are in `engine_state()`, so a resume draws on exactly.
    """
    value = base_seed & 0xFFFFFFFFFFFF
    for part in (pass_index, layer_index, microbatch_index):
        value = (value * 1_000_003 + part + 1) % (2**61 - 1)
    return value


GRAD_DOWNLOAD_SLICE = 32 * 2**20  # elements per gradient copy: bounds the device-side dtype conversion's buffer


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



def _nothing() -> None:
    pass


NO_SPAN = (_nothing, _nothing)  # the (begin, finish) of a span that is not recorded

class Payload:
    """Tensors one task hands to another: on the host (readable once `event` completed), or still on the device of
    worker `worker_index` when the consumer is that same worker (same stream: no copy, no wait)."""

    __slots__ = ("tensors", "event", "worker_index")

    def __init__(self, tensors: tuple, event=None, worker_index: int | None = None) -> None:
        self.tensors = tensors
        self.event = event
        self.worker_index = worker_index

    def host(self) -> tuple:
        """The tensors, once readable by the CPU."""
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        return self.tensors


class Device:
    """[Note: transfer engine]
    A CUDA worker has one compute stream and four copy streams: activation upload, activation download, parameter
    upload, gradient download (PCIe is full duplex, and parameters and gradients then never queue behind the
    activations on the critical path). Nothing blocks the worker thread on the GPU: every copy records an event,
    consumers wait on it on their own stream (or, on the CPU, when they read), and tensors used across streams are
    handed to the caching allocator with `record_stream` so their memory is not reused too early. A task's next
    task on the same worker takes its activations straight from the device (no host round trip).
    """

    def __init__(self, device: torch.device, index: int) -> None:
        self.device = device
        self.index = index
        self.is_cuda = device.type == "cuda"
        self._rng_lock = _rng_lock(device)
        self.compute_stream = self.act_in = self.act_out = self.param_in = self.grad_out = None
        self.trace = None  # a TraceRecorder: copies then get spans on their own stream's track

    def __str__(self) -> str:
        return f"d{self.index}({self.device})"

    def start_thread(self) -> None:
        """Called on the worker's own thread before it runs anything."""
        if self.is_cuda:
            torch.cuda.set_device(self.device)
            self.compute_stream, self.act_in, self.act_out, self.param_in, self.grad_out = (
                torch.cuda.Stream(self.device) for _ in range(5))

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        if self.is_cuda:
            with torch.cuda.stream(self.compute_stream):
                yield
        else:
            yield

    # -------------------------------------------------------------- host -> device

    def _traced(self, stream, track: str, tensors):
        """(start, finish) callables bracketing a copy on `stream` with trace events (no-ops when not tracing)."""
        if self.trace is None:
            return NO_SPAN
        size = sum(t.numel() * t.element_size() for t in tensors if t is not None) / 2**20
        return self._span(stream, track, f"{size:.1f} MiB")

    def _span(self, stream, track: str, name: str):
        """(start, finish) callables recording a span of `stream`'s work named `name` on this device's `track`."""
        start, end = self.trace.cuda_events(self.device, stream)

        def finish() -> None:
            end.record(stream)
            self.trace.add_cuda_span(f"{self} {track}", name, self.device, start, end)

        return (lambda: start.record(stream)), finish

    def _upload(self, tensors, stream, after_event=None, track: str = "upload") -> tuple[list, list]:
        """Copies of `tensors` on the device and one copy event per tensor (None on the CPU), so a consumer can
        start on the first tensor while the others are still in flight; the copies run in order on one stream, so
        the last event covers them all."""
        if not self.is_cuda:
            out = [None if t is None else t.clone() for t in tensors]
            return out, [None] * len(out)
        with torch.cuda.stream(stream):
            if after_event is not None:
                stream.wait_event(after_event)
            begin, finish = self._traced(stream, track, tensors)
            begin()
            out, events = [], []
            for t in tensors:
                out.append(None if t is None else t.to(self.device, non_blocking=True))
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
                t.record_stream(self.compute_stream)

    def empty_params(self, hosts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Device buffers shaped like the host compute copies `hosts`, for `upload_params_into` (allocated on the
        parameter-upload stream, as the copies into them run there)."""
        if not self.is_cuda:
            return [torch.empty_like(h) for h in hosts]
        with torch.cuda.stream(self.param_in):
            return [torch.empty(h.shape, dtype=h.dtype, device=self.device) for h in hosts]

    def upload_params_into(self, flats: list[torch.Tensor], hosts: list[torch.Tensor]) -> list:
        """Start copying host buckets (compute copies, or optimizer copies in another dtype, cast on the device)
        into the device buffers `flats`; returns one copy event per bucket (None on the CPU: the copy is already
        done). Call `use_params` for a bucket before computing with it: a task's first layer can start as soon as
        its own bucket has landed."""
        faults.point("transfer.upload")
        if not self.is_cuda:
            for flat, host in zip(flats, hosts):
                flat.copy_(host)
            return [None] * len(flats)
        with torch.cuda.stream(self.param_in):
            begin, finish = self._traced(self.param_in, "parameter upload", hosts)
            begin()
            events = []
            for flat, host in zip(flats, hosts):
                if host.dtype == flat.dtype:
                    flat.copy_(host, non_blocking=True)
                else:
                    self._upload_and_cast(flat, host)
                events.append(self.param_in.record_event())
            finish()
            return events

    def _upload_and_cast(self, flat: torch.Tensor, host: torch.Tensor) -> None:
        """Copy `host` to the device in its own dtype, then cast into `flat`, in chunks through one staging
        buffer (torch's own cross-device copy with a dtype change would cast on the host first)."""
        staging = torch.empty(min(host.numel(), UPLOAD_CAST_CHUNK), dtype=host.dtype, device=self.device)
        for start in range(0, host.numel(), UPLOAD_CAST_CHUNK):
            part = host[start:start + UPLOAD_CAST_CHUNK]
            stage = staging[:part.numel()]
            stage.copy_(part, non_blocking=True)
            flat[start:start + part.numel()].copy_(stage)  # same stream: the next chunk's copy waits for this cast

    def use_params(self, flats: list[torch.Tensor], event) -> None:
        self._use(flats, event)

    @property
    def traces_weight_waits(self) -> bool:
        return self.trace is not None and self.is_cuda

    def weights_wait(self, layer_index: int):
        """(begin, finish) callables bracketing, on the compute stream, the wait for a layer's parameters: its
        version being written (the host waits) and its upload landing (the stream waits). Traced on CUDA as a span
        of the `weights wait` track, which a compute span alone hides: the task's span covers its waits
        ([Note: weight waits in the trace] in `telemetry/report.py`). No-ops when not tracing."""
        if not self.traces_weight_waits:
            return NO_SPAN
        return self._span(self.compute_stream, "weights wait", f"L{layer_index}")

    def can_keep(self, tensors: tuple, limit_bytes: int) -> bool:
        """Whether `tensors` may stay on this device (instead of a host round trip) without the device's allocated
        memory passing `limit_bytes`."""
        if limit_bytes <= 0:
            return False
        if not self.is_cuda:
            return True  # CPU workers: the limit only switches the path (tests exercise both)
        size = sum(t.numel() * t.element_size() for t in tensors if t is not None)
        return torch.cuda.memory_allocated(self.device) + size <= limit_bytes

    def receive(self, payload: Payload) -> tuple:
        """The payload's tensors on this device, ready for the compute stream."""
        if payload.worker_index == self.index:
            return payload.tensors
        faults.point("transfer.upload")
        if not self.is_cuda:
            out, _ = self._upload(payload.host(), None)
            return tuple(out)
        event, payload.event = payload.event, None
        out, events = self._upload(payload.tensors, self.act_in, after_event=event, track="activation upload")
        self._use(out, events[-1] if events else None)
        return tuple(out)

    # -------------------------------------------------------------- device -> host

    def _download(self, tensors, stream, track: str = "download") -> tuple[tuple, object]:
        if not self.is_cuda:
            return tuple(None if t is None else t.detach().clone() for t in tensors), None
        stream.wait_stream(self.compute_stream)
        with torch.cuda.stream(stream):
            begin, finish = self._traced(stream, track, tensors)
            begin()
            out = []
            for t in tensors:
                if t is None:
                    out.append(None)
                    continue
                out.append(t.detach().to("cpu", non_blocking=True))
                t.record_stream(stream)
            finish()
            return tuple(out), stream.record_event()

    def send(self, tensors: tuple, keep_on_device: bool) -> Payload:
        """Hand tensors to the next task: kept on this device for the same worker, else copied to the host."""
        if keep_on_device:
            return Payload(tuple(None if t is None else t.detach() for t in tensors), None, self.index)
        faults.point("transfer.download")
        host, event = self._download(tensors, self.act_out, track="activation download")
        return Payload(host, event)

    def download_grads_into(self, grads: list[torch.Tensor], outs: list[torch.Tensor]) -> Payload:
        """Copy each flat device gradient into the host buffer `outs[i]`, converting to its dtype on the way (on the
        device, a slice at a time, so the converted copy never needs a whole bucket's worth of device memory).
        The payload's tensors are `outs` followed by one host tensor of their squared L2 norms, in `outs`' dtype,
        measured where the gradients are ([Note: device norms])."""
        faults.point("transfer.download")
        squares = torch.stack([_squared_norm(g.detach(), o.dtype) for g, o in zip(grads, outs)])
        if not self.is_cuda:
            for grad, out in zip(grads, outs):
                out.copy_(grad.detach())
            return Payload(tuple(outs) + (squares,))
        stream = self.grad_out
        stream.wait_stream(self.compute_stream)
        with torch.cuda.stream(stream):
            begin, finish = self._traced(stream, "gradient download", outs)
            begin()
            for grad, out in zip(grads, outs):
                flat = grad.detach()
                for start in range(0, flat.numel(), GRAD_DOWNLOAD_SLICE):
                    end = start + GRAD_DOWNLOAD_SLICE
                    out[start:end].copy_(flat[start:end], non_blocking=True)
                flat.record_stream(stream)
            host_squares = torch.empty(squares.shape, dtype=squares.dtype, pin_memory=True)
            host_squares.copy_(squares, non_blocking=True)
            squares.record_stream(stream)
            finish()
            return Payload(tuple(outs) + (host_squares,), stream.record_event())

    @contextlib.contextmanager
    def rng(self, seed: int) -> Iterator[None]:
        """The layer run inside draws from the stream `seed`.

        [Note: CUDA worker RNG]
        A CUDA worker seeds the device's default CUDA generator and holds the device's lock while the layer launches
        its kernels (each takes its offset from the generator at launch), so workers sharing the device never
        interleave. That generator is process-wide: a user thread drawing CUDA random numbers on the same device
        while a worker runs a layer (`torch.rand(..., device="cuda")`, a CUDA dropout outside the engine) moves the
        layer's stream, and its recomputation then differs from its forward; and a layer drawing CPU random numbers
        on a CUDA worker draws from the unseeded process-wide CPU generator. CPU draws on user threads are unaffected.
        Lifting this would take a `torch.Generator(device="cuda")` per stream handed to every random op, a per-op
        Python dispatch on the GPU's hot path ([Note: CPU worker RNG] pays it on CPU workers only); torch has no
        per-thread default generator.
        """
        if self.is_cuda:
            with self._rng_lock:
                torch.cuda.manual_seed(seed)  # RNG state is taken when kernels launch: the lock can end here
                yield
            return
        with StreamRandom(seed):  # never the process-wide generator ([Note: CPU worker RNG])
            yield
