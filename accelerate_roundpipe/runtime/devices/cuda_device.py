"""A GPU worker's device: CUDA streams, events, asynchronous copies through page-locked memory, and the device's
generator and allocator counters ([Note: transfer engine], [Note: CUDA worker RNG])."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from .device import Device
from .payload import NO_SPAN

# Workers on the same device (two workers given the same GPU) share that device's generator; seeding it for a layer
# and launching the layer must not interleave with another worker doing the same.
_RNG_LOCKS: dict[str, threading.Lock] = {}
_RNG_LOCKS_GUARD = threading.Lock()


def _rng_lock(device: torch.device) -> threading.Lock:
    with _RNG_LOCKS_GUARD:
        return _RNG_LOCKS.setdefault(str(device), threading.Lock())


class KernelTimer:
    """Times the work queued on a stream between its creation and `stop()`, with CUDA events read later (nothing
    waits on the GPU until `elapsed_s`)."""

    __slots__ = ("stream", "start", "end", "seconds")

    def __init__(self, stream) -> None:
        self.stream, self.seconds = stream, None
        self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.start.record(stream)

    def stop(self) -> None:
        self.end.record(self.stream)

    def elapsed_s(self) -> float:
        if self.seconds is None:
            self.end.synchronize()
            self.seconds = self.start.elapsed_time(self.end) / 1e3
        return self.seconds


class CudaDevice(Device):
    is_cuda = True
    records_kernel_time = True
    tracks_memory = True

    def __init__(self, device: torch.device, index: int) -> None:
        super().__init__(device, index)
        self._rng_lock = _rng_lock(self.device)

    def start_thread(self) -> None:
        torch.cuda.set_device(self.device)
        self.compute_stream, self.act_in, self.act_out, self.param_in, self.grad_out = (
            torch.cuda.Stream(self.device) for _ in range(5))

    def _on_stream(self, stream):
        return torch.cuda.stream(stream)

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.device, non_blocking=True)

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to("cpu", non_blocking=True)  # into page-locked memory torch allocates for it

    def _copy_to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def _copy_to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def _copy_on_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def _page_locked_empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def _hold(self, tensor: torch.Tensor, stream) -> None:
        tensor.record_stream(stream)

    def _fits(self, size: int, limit_bytes: int) -> bool:
        return torch.cuda.memory_allocated(self.device) + size <= limit_bytes

    def kernel_span(self, stream, track: str, name: str):
        if self.trace is None:
            return NO_SPAN
        start, end = self.trace.cuda_events(self.device, stream)

        def finish() -> None:
            end.record(stream)
            self.trace.add_cuda_span(f"{self} {track}", name, self.device, start, end)

        return (lambda: start.record(stream)), finish

    def timer(self) -> KernelTimer:
        return KernelTimer(self.compute_stream)

    def upload_timer(self) -> KernelTimer:
        return KernelTimer(self.param_in)

    def reset_peak_memory(self) -> None:
        # The allocator's peak counter, reset here, gives a layer's transient peak (only while profiling: a user
        # reading max_memory_allocated afterwards sees the peak since the measured pass).
        torch.cuda.reset_peak_memory_stats(self.device)

    def allocated_bytes(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def peak_allocated_bytes(self) -> int | None:
        return torch.cuda.max_memory_allocated(self.device)

    def total_memory_bytes(self) -> int | None:
        return torch.cuda.get_device_properties(self.device).total_memory

    @contextlib.contextmanager
    def rng(self, seed: int) -> Iterator[None]:
        """[Note: CUDA worker RNG]
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
        with self._rng_lock:
            torch.cuda.manual_seed(seed)  # RNG state is taken when kernels launch: the lock can end here
            yield
