"""Host buffers that gradient downloads land in, recycled at their exact size.

[Note: gradient swap]
A bucket's gradients reach the host already in the optimizer's dtype: the device converts them while it copies
(`Device.download_grads_into`) into a buffer from this pool. The commit then does no host pass at all in the common
case: when the bucket holds no gradient (the first commit after `zero_grad`), the downloaded buffer *becomes* the
bucket's gradient buffer. Only a commit into a buffer that already holds gradients (accumulation across tasks or
passes) adds, and gives the download back. Before, every commit was a bf16 -> fp32 host pass over the whole model
per step (about 0.4 s for Qwen3-1.7B on 16 cores), competing with the CPU optimizer for memory bandwidth.

Buffers are pinned when the engine pins (a GPU is used), at their exact size ([Note: exact-size pinned memory]).

[Note: no spare gradient buffer]
A host bucket holds a gradient buffer only while it holds gradients: the store makes none at build (the first
download's buffer becomes it, so the build page-locks no gradient), and `zero_grad(set_to_none=True)` gives the
bucket's buffer back to the pool (`Bucket.clear`); a row-window commit into an empty bucket takes a whole buffer
from the pool and zeroes it outside the window. No number changes: an empty bucket's buffer is never read (the swap
replaces it, the window commit zeroes what it does not write). Before, a bucket kept its buffer after `zero_grad`
and the buffer its first download swapped out stayed in the pool as a spare: 4 bytes a trainable parameter more
than the gradients (1 on a model of equal layers, whose buckets share the spares of their size).

So that a burst (every gradient of a clipped or accumulated step, downloads that overlapped) does not stay in the
free list, the pool counts, per size, the buffers out of it (in downloads or held by buckets) and the most out at
once since that size was last idle; when the last one comes back (the size is idle) the free buffers beyond the most
of its last `KEEP_PERIODS` busy periods are released (unlocked first: [Note: unlock before free]). A run's steady
state keeps what its steps need at once, so nothing is allocated anew each step, even when the number in flight
differs by one from a step to the next (the backlog of the host step jitters): releasing at the one period's most
would then unlock and page-lock a buffer every other step, on the worker's thread before its download (and
`give_back` waits for every device). A burst stays for `KEEP_PERIODS` busy periods of its size, then goes. A size
never idle (gradients kept with `zero_grad(set_to_none=False)`) keeps at most
the downloads that were in flight at once.
"""

from __future__ import annotations

import threading
from collections import deque

import torch

from ..devices.pinned import HostMemory

KEEP_PERIODS = 4  # busy periods of a size whose most out at once the free list keeps ([Note: no spare gradient buffer])


class GradBufferPool:
    def __init__(self, memory: HostMemory) -> None:
        self.memory = memory
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self._out: dict[tuple[int, torch.dtype], int] = {}  # per size: buffers taken and not given back
        self._peak: dict[tuple[int, torch.dtype], int] = {}  # per size: the most out at once since it was idle
        self._recent: dict[tuple[int, torch.dtype], deque[int]] = {}  # per size: the last busy periods' most
        self._lock = threading.Lock()
        self.allocated = 0  # buffers made so far: flat in the steady state, when every download reuses one
        self.released = 0  # buffers let go of beyond what the last busy period of their size needed
        self.bytes = 0  # of every buffer the pool made and did not release (free, in downloads, held by buckets)
        self.peak_bytes = 0  # the most `bytes` so far: the gradient buffers alive at once (benchmarks/host_bytes.py)

    def take(self, like: torch.Tensor) -> torch.Tensor:
        """A free buffer of `like`'s size and dtype (contents undefined); give it back when nobody reads it."""
        key = (like.numel(), like.dtype)
        with self._lock:
            out = self._out[key] = self._out.get(key, 0) + 1
            self._peak[key] = max(self._peak.get(key, 0), out)
            free = self._free.get(key)
            if free:
                return free.pop()
            self.allocated += 1
            self.bytes += like.numel() * like.element_size()
            self.peak_bytes = max(self.peak_bytes, self.bytes)
        return self.memory.empty(like.numel(), like.dtype)

    def give(self, buffer: torch.Tensor) -> None:
        """Return a buffer `take` handed out, once nobody reads it (its device copy, if any, has completed)."""
        key = (buffer.numel(), buffer.dtype)
        excess: list[torch.Tensor] = []
        with self._lock:
            free = self._free.setdefault(key, [])
            free.append(buffer)
            self._out[key] = self._out.get(key, 0) - 1
            if self._out[key] <= 0:  # idle: keep what its busy period needed at once ([Note: no spare gradient buffer])
                self._out[key] = 0
                recent = self._recent.setdefault(key, deque(maxlen=KEEP_PERIODS))
                recent.append(self._peak.pop(key, 1))
                keep = max(recent)
                excess, free[keep:] = free[keep:], []
            self.released += len(excess)
            self.bytes -= sum(t.numel() * t.element_size() for t in excess)
        if excess:
            self.memory.give_back(*excess)

    def release(self) -> None:
        """The engine closed: let go of the free buffers ([Note: memory freed at close])."""
        with self._lock:
            self._free.clear()
            self.bytes = 0

    def free_bytes(self) -> int:
        with self._lock:
            return sum(t.numel() * t.element_size() for free in self._free.values() for t in free)

    def out_count(self) -> int:
        """Buffers handed out and not given back (in downloads or held by buckets)."""
        with self._lock:
            return sum(self._out.values())
