"""Page-locked host memory at its exact size, unlocked when closed or collected.

[Note: exact-size pinned memory]
`torch.empty(..., pin_memory=True)` goes through torch's caching host allocator, which rounds every block up to a
power of two: a Qwen3-4B layer's 400 MB gradient buffer locks 512 MB, its 1.6 GB embedding gradient 2 GiB. Over a
model's compute copy, gradients and their spares that is 10-15 GiB of locked RAM for nothing on Qwen3-4B (measured
host peak 107.6 GiB on a 125 GiB machine). Here ordinary memory is allocated at the exact size and page-locked in
place (`cudaHostRegister`); copies to and from it are asynchronous like any pinned memory.

[Note: unlock before free]
A locked range must be unlocked before its memory is freed. Freed while registered, the allocator hands the same
addresses out again (a large block is unmapped and the next large one mapped where it was), and the next
`cudaHostRegister` over them fails with "part or all of the requested memory range is already mapped": the third
`RoundPipeTrainer` in a notebook or a sweep failed so, once the first engines had been collected without `close()`
(a Trainer leaves its engine open: the model is evaluated and saved after `train()`). So the locked buffers are
held by a finalizer of the `HostMemory`, not by the object: `release()` (at `engine.close()`) or the collection of
the `HostMemory` (with its engine) unlocks them after the devices are done with them, and only then can their memory
be freed. The tensors stay valid as ordinary memory (your module's parameters still view the compute copy).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref

import torch

logger = logging.getLogger(__name__)

_NEVER_FREED: list[torch.Tensor] = []  # buffers that could not be unlocked: freeing them would leak the lock


class CudaHostLocks:
    """Page-locks memory in place with the CUDA runtime."""

    def lock(self, buffer: torch.Tensor) -> None:
        nbytes = buffer.numel() * buffer.element_size()
        status = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 0)
        try:
            torch.cuda.check_error(status)
        except RuntimeError as error:
            raise RuntimeError(
                f"could not page-lock {nbytes / 2**30:.2f} GiB of host memory ({error}); free host memory, or set "
                f"RoundPipeConfig(pin_memory=False) (env ROUNDPIPE_PIN_MEMORY=0; host-device copies then stall "
                f"the pipeline)") from error

    def unlock(self, buffers: list[torch.Tensor]) -> bool:
        """Unlock `buffers` once no copy can still read or write them; False (and still locked) if the devices
        cannot be synchronized."""
        try:
            for device in range(torch.cuda.device_count()):
                torch.cuda.synchronize(device)
        except RuntimeError as error:  # a device in an error state: keep the lock rather than risk a live copy
            logger.warning("RoundPipe left %.2f GiB of host memory page-locked: the device could not be synchronized "
                           "(%s)", sum(t.numel() * t.element_size() for t in buffers) / 2**30, error)
            return False
        for buffer in buffers:
            torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
        return True


class _LockedBuffers:
    """What a `HostMemory` locked, owned apart from it so that its finalizer can unlock them
    ([Note: unlock before free]). Every change goes through the lock: the engine's threads allocate gradient
    buffers."""

    def __init__(self, locks) -> None:
        self.locks = locks
        self.buffers: list[torch.Tensor] = []  # kept alive until unlocked: freeing locked memory leaks the lock
        self.mutex = threading.Lock()

    def add(self, buffer: torch.Tensor) -> None:
        with self.mutex:
            self.buffers.append(buffer)

    @property
    def nbytes(self) -> int:
        with self.mutex:
            return sum(t.numel() * t.element_size() for t in self.buffers)

    def unlock_all(self, pointers: set[int] | None = None) -> None:
        """Unlock the buffers (those at `pointers` only, when given) and let go of them."""
        with self.mutex:
            chosen = [t for t in self.buffers if pointers is None or t.data_ptr() in pointers]
            self.buffers = [t for t in self.buffers if pointers is not None and t.data_ptr() not in pointers]
        if chosen and not self.locks.unlock(chosen):
            _NEVER_FREED.extend(chosen)


class HostMemory:
    """Host buffers at their exact size, page-locked when `pinned` ([Note: exact-size pinned memory])."""

    def __init__(self, pinned: bool, locks=None) -> None:
        self.pinned = pinned
        self._locked = _LockedBuffers(locks if locks is not None else CudaHostLocks())
        # Collected without release(): unlock before the buffers' memory can be freed ([Note: unlock before free]).
        self._finalizer = weakref.finalize(self, self._locked.unlock_all)
        self._finalizer.atexit = False  # at exit the process's memory goes with it; CUDA may be torn down already

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        buffer = torch.empty(numel, dtype=dtype)
        if self.pinned and numel:
            self._locked.locks.lock(buffer)
            self._locked.add(buffer)
        return buffer

    def zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.empty(numel, dtype).zero_()

    def lock(self, buffer: torch.Tensor) -> None:
        """Page-lock `buffer` (a contiguous CPU tensor of this process, allocated unlocked) in place, when pinned;
        it is then held and unlocked as the buffers of `empty` are. Locking the same buffer twice is refused by
        CUDA: callers lock each once."""
        if self.pinned and buffer.numel():
            self._locked.locks.lock(buffer)
            self._locked.add(buffer)

    @property
    def locked_bytes(self) -> int:
        return self._locked.nbytes

    def give_back(self, *buffers: torch.Tensor) -> None:
        """Unlock `buffers` (no longer used by the engine: a bucket moved to its device) so their memory is freed
        with them; waits for the devices first, as `release` does."""
        self._locked.unlock_all({t.data_ptr() for t in buffers if t is not None})

    def release(self) -> None:
        """Unlock everything (waits for the devices first: a copy may still be reading or writing)."""
        self._locked.unlock_all()


def unrounded_pinned_cache_hazard(environ=None) -> str | None:
    """[Note: unrounded page-locked blocks]
    torch's caching host allocator rounds each page-locked block up to a power of two and keeps freed blocks in one
    free list per power of two, handing out the last one of the request's list without comparing sizes. With
    `pinned_max_round_threshold_mb:N` in `PYTORCH_ALLOC_CONF` (or `PYTORCH_CUDA_ALLOC_CONF`) and no
    `pinned_max_cached_size_mb` at or below N, blocks above N MiB are neither rounded nor freed, so one list holds
    blocks of several sizes and a request can get a smaller block than it asked for: a copy into it writes past its
    end (pytorch/pytorch#192722; the torch 2.13 headers still take the block unchecked). RoundPipe's saved layer
    inputs and activations cross to the host through that allocator in several sizes (micro-batches of uneven rows,
    sequences padded per batch). The engine does not change the user's allocator settings; it says this at the start,
    naming what to change. Returns the warning, or None when the settings are safe."""
    environ = os.environ if environ is None else environ
    settings: dict[str, str] = {}
    text = environ.get("PYTORCH_ALLOC_CONF") or environ.get("PYTORCH_CUDA_ALLOC_CONF") or ""  # torch reads one
    for item in text.split(","):
        key, _, value = item.partition(":")
        if key.strip():
            settings[key.strip()] = value.strip()
    threshold, cached = settings.get("pinned_max_round_threshold_mb"), settings.get("pinned_max_cached_size_mb")
    if threshold is None:
        return None
    try:
        if cached is not None and float(cached) <= float(threshold):
            return None
    except ValueError:
        pass
    return (f"the allocator settings set pinned_max_round_threshold_mb:{threshold} without pinned_max_cached_size_mb "
            f"at or below it: torch's page-locked cache can then hand a copy a block smaller than the copy "
            f"(pytorch/pytorch#192722), and RoundPipe sends layer inputs of several sizes through it. Remove "
            f"pinned_max_round_threshold_mb from PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF, or add "
            f"pinned_max_cached_size_mb:{threshold} (blocks above it are then freed, not cached).")


def release_cached_pinned_memory(accelerator=None, private=None) -> bool:
    """[Note: the measured pass's pinned blocks released]
    Saved layer inputs and activations cross to the host into page-locked blocks of torch's caching host allocator
    (`tensor.to("cpu", non_blocking=True)`), which keeps every freed block for a later one of its (power-of-two)
    size and never gives it back. The measured pass runs the unplanned partition, one layer per backward stage, so
    it saves the input of every layer: Qwen3-4B at 64 rows of 4096 tokens, 36 inputs of 1.25 GiB in each of 4
    micro-batches, 45 GiB or more; the planned passes after it save a few inputs of other sizes and could reuse none
    of those blocks, and a run with its optimizer state on the host was killed for memory in its second pass. So
    once the measured pass has finished and the plan changed what the passes save, the blocks nobody holds go back
    (`torch.accelerator.empty_host_cache` where this torch has it and an accelerator is in use; torch 2.11, which
    has not, names the same call `torch._C._host_emptyCache`; blocks still held or with copies in flight stay).
    Returns whether it ran. `accelerator`, `private`: `torch.accelerator` and `torch._C` unless given."""
    accelerator = accelerator if accelerator is not None else getattr(torch, "accelerator", None)
    private = private if private is not None else torch._C
    if accelerator is None or not accelerator.is_available():
        return False
    empty = getattr(accelerator, "empty_host_cache", None) or getattr(private, "_host_emptyCache", None)
    if empty is None:
        return False
    empty()
    return True
