"""A worker's device: how tensors get on and off it, and its RNG streams.

A CPU "device" is a worker thread with its own copies: uploads and downloads clone, exactly as a GPU would copy,
so the scheduler, the event protocol and the optimizer are exercised unchanged without a GPU.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from . import faults

# Workers on the same device (every CPU worker, or two workers given the same GPU) share that device's generator;
# seeding it for a layer and launching the layer must not interleave with another worker doing the same.
_RNG_LOCKS: dict[str, threading.Lock] = {}
_RNG_LOCKS_GUARD = threading.Lock()


def _rng_lock(device: torch.device) -> threading.Lock:
    with _RNG_LOCKS_GUARD:
        return _RNG_LOCKS.setdefault(str(device), threading.Lock())


def stream_seed(base_seed: int, pass_index: int, layer_index: int, microbatch_index: int) -> int:
    """The RNG seed of one layer on one micro-batch of one pass: the forward and its recomputation draw the same
    masks whatever device or thread runs them."""
    value = base_seed & 0xFFFFFFFFFFFF
    for part in (pass_index, layer_index, microbatch_index):
        value = (value * 1_000_003 + part + 1) % (2**61 - 1)
    return value


class Device:
    def __init__(self, device: torch.device, index: int) -> None:
        self.device = device
        self.index = index
        self.is_cuda = device.type == "cuda"
        self.stream = None
        self._rng_lock = _rng_lock(device)

    def __str__(self) -> str:
        return f"d{self.index}({self.device})"

    def start_thread(self) -> None:
        """Called on the worker's own thread before it runs anything."""
        if self.is_cuda:
            torch.cuda.set_device(self.device)
            self.stream = torch.cuda.Stream(self.device)

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        if self.is_cuda:
            with torch.cuda.stream(self.stream):
                yield
        else:
            yield

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        faults.point("transfer.upload")
        if self.is_cuda:
            return host.to(self.device, non_blocking=True)
        return host.clone()

    def download(self, tensor: torch.Tensor) -> torch.Tensor:
        faults.point("transfer.download")
        if self.is_cuda:
            return tensor.detach().to("cpu", non_blocking=True)
        return tensor.detach().clone()

    def synchronize(self) -> None:
        """Wait for every copy and kernel issued so far (results downloaded may be read after this)."""
        if self.is_cuda:
            self.stream.synchronize()

    @contextlib.contextmanager
    def rng(self, seed: int) -> Iterator[None]:
        if self.is_cuda:
            with self._rng_lock:
                torch.cuda.manual_seed(seed)  # RNG state is taken when kernels launch: the lock can end here
                yield
            return
        with self._rng_lock:
            saved = torch.get_rng_state()
            torch.manual_seed(seed)
            try:
                yield
            finally:
                torch.set_rng_state(saved)
