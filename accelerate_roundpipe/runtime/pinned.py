"""Page-locked host memory at its exact size.

[Note: exact-size pinned memory]
`torch.empty(..., pin_memory=True)` goes through torch's caching host allocator, which rounds every block up to a
power of two: a Qwen3-4B layer's 400 MB gradient buffer locks 512 MB, its 1.6 GB embedding gradient 2 GiB. Over a
model's compute copy, gradients and their spares that is 10-15 GiB of locked RAM for nothing on Qwen3-4B (measured
host peak 107.6 GiB on a 125 GiB machine). Here ordinary memory is allocated at the exact size and page-locked in
place (`cudaHostRegister`); copies to and from it are asynchronous like any pinned memory.

`release()` (at `engine.close()`) unlocks everything after the device has finished with it; the tensors stay valid
as ordinary memory (your module's parameters still view the compute copy).
"""

from __future__ import annotations

import logging
import threading

import torch

logger = logging.getLogger(__name__)


class HostMemory:
    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned
        self._locked: list[torch.Tensor] = []  # kept alive until unlocked: freeing locked memory would leak the lock
        self._lock = threading.Lock()

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        buffer = torch.empty(numel, dtype=dtype)
        if self.pinned and numel:
            nbytes = numel * buffer.element_size()
            status = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 0)
            try:
                torch.cuda.check_error(status)
            except RuntimeError as error:
                raise RuntimeError(
                    f"could not page-lock {nbytes / 2**30:.2f} GiB of host memory ({error}); free host memory, or set "
                    f"RoundPipeConfig(pin_memory=False) (env ROUNDPIPE_PIN_MEMORY=0; host-device copies then stall "
                    f"the pipeline)") from error
            with self._lock:
                self._locked.append(buffer)
        return buffer

    def zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.empty(numel, dtype).zero_()

    @property
    def locked_bytes(self) -> int:
        with self._lock:
            return sum(t.numel() * t.element_size() for t in self._locked)

    def release(self) -> None:
        """Unlock everything (waits for the devices first: a copy may still be reading or writing)."""
        with self._lock:
            locked, self._locked = self._locked, []
        if not locked:
            return
        try:
            for device in range(torch.cuda.device_count()):
                torch.cuda.synchronize(device)
        except RuntimeError as error:  # a device in an error state: keep the lock rather than risk a live copy
            logger.warning("RoundPipe left %.2f GiB of host memory page-locked: the device could not be synchronized "
                           "(%s)", sum(t.numel() * t.element_size() for t in locked) / 2**30, error)
            return
        for buffer in locked:
            torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
