"""Host buffers that gradient downloads land in, recycled at their exact size.

[Note: gradient swap]
A bucket's gradients reach the host already in the optimizer's dtype: the device converts them while it copies
(`Device.download_grads_into`) into a buffer from this pool. The commit then does no host pass at all in the common
case: when the bucket's gradient buffer is empty (the first commit after `zero_grad`), the downloaded buffer *becomes*
the bucket's gradient buffer and the old one returns to the pool. Only a commit into a buffer that already holds
gradients (accumulation across tasks or passes) adds. Before, every commit was a bf16 -> fp32 host pass over the
whole model per step (about 0.4 s for Qwen3-1.7B on 16 cores), competing with the CPU optimizer for memory
bandwidth.

Buffers are pinned when the engine pins (a GPU is used), at their exact size ([Note: exact-size pinned memory]). In
the steady state there is one spare per bucket: the gradients cost twice their size in host memory, against once plus
a bf16 staging copy before.
"""

from __future__ import annotations

import threading

import torch

from ..devices.pinned import HostMemory


class GradBufferPool:
    def __init__(self, memory: HostMemory) -> None:
        self.memory = memory
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.allocated = 0  # buffers made so far: flat in the steady state, when every download reuses one

    def take(self, like: torch.Tensor) -> torch.Tensor:
        """A free buffer of `like`'s size and dtype (contents undefined)."""
        with self._lock:
            free = self._free.get((like.numel(), like.dtype))
            if free:
                return free.pop()
            self.allocated += 1
        return self.memory.empty(like.numel(), like.dtype)

    def give(self, buffer: torch.Tensor) -> None:
        """Return a buffer nobody reads any more (its device copy, if any, has completed)."""
        with self._lock:
            self._free.setdefault((buffer.numel(), buffer.dtype), []).append(buffer)

    def free_bytes(self) -> int:
        with self._lock:
            return sum(t.numel() * t.element_size() for free in self._free.values() for t in free)
