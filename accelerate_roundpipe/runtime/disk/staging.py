"""Bounded staging for buckets whose state lives on disk: K slots, reads started ahead in the order the buckets will
be needed, written back after their step, never more than K in memory.

[Note: disk staging protocol]
The slots are allocated once, together (page-locked when CUDA is available, so a slot can be the source and target
of asynchronous copies; plain memory otherwise), each the size of the largest bucket, and hold a bucket's file image:
its tensors at the file's offsets. The caller gives the order in which it will need the buckets (`schedule`: the
backward visits layers last to first, so the exact step's order is known before the pass) and then, for each in that
order, `acquire(key)` (the bucket's tensors, read) and `release(key, dirty)`: a dirty slot is written back to its
file and only then freed, a clean one is freed at once. Whenever a slot is free the next scheduled bucket's read
starts into it, so up to K reads run ahead of the step; a bucket is read again only once its last write-back is on
disk. A slot is in use from the start of its read to the end of its write-back: never more than K (`in_use`,
`peak_in_use`).

Refused with `StagingOrderError`: an acquire of any bucket but the next scheduled one, an acquire while the caller
holds all K slots or the same bucket (its read could never start), a release of a bucket not held, any call after
close(). Any I/O failure is kept and raised, naming the file, by the call that waits on it (acquire for a read,
flush for a write-back) or by the next call (the next schedule, acquire, release, flush or close); after one, the
staging is broken and every call raises it. No wait is longer than `timeout_s`. `flush()` waits for the write-backs
in flight, after which the files of buckets not in a slot hold their newest values. `close()` waits for the I/O in
flight (within `timeout_s`), then closes and removes the swap files and their folder; buckets still held are dropped
unwritten (the swap files are no checkpoint: [Note: swap folder ownership]).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

import torch

from .errors import StagingOrderError, SwapIOError, SwapTimeoutError
from .io_threads import CHUNK_BYTES, Hook, IOThreads, Span, Transfer
from .swap_files import SwapFiles


def allocate_slots(nbytes: int, pin_memory: bool | None) -> torch.Tensor:
    """The slots' one buffer: page-locked when asked (None: when CUDA is available). One allocation, so torch's
    pinned allocator rounds it up to a power of two once, not once per slot."""
    pin = torch.cuda.is_available() if pin_memory is None else pin_memory
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


@dataclass
class _Staged:
    slot: int
    read: Transfer
    held: bool = False


class DiskStaging:
    """K staging slots over `files`, with their prefetcher ([Note: disk staging protocol])."""

    def __init__(self, files: SwapFiles, slots: int, *, io_threads: int | None = None, timeout_s: float = 60.0,
                 hook: Hook | None = None, pin_memory: bool | None = None,
                 allocate: Callable[[int], torch.Tensor] | None = None, chunk_bytes: int = CHUNK_BYTES,
                 span: Span | None = None) -> None:
        if slots < 1:
            raise ValueError(f"disk staging needs at least 1 slot, got {slots}")
        if not timeout_s > 0:
            raise ValueError(f"the disk staging's timeout must be positive, got {timeout_s}")
        self.files, self.slots, self.timeout_s = files, slots, timeout_s
        self.slot_bytes = max((layout.nbytes for layout in files.layouts.values()), default=0)
        total = slots * self.slot_bytes
        self._buffer = (allocate or (lambda n: allocate_slots(n, pin_memory)))(total)
        if self._buffer.dtype != torch.uint8 or self._buffer.numel() < total:
            raise ValueError(f"allocate({total}) must return at least {total} uint8 elements")
        self._slot_buffers = [self._buffer[i * self.slot_bytes:(i + 1) * self.slot_bytes] for i in range(slots)]
        self._io = IOThreads(io_threads, chunk_bytes, hook, span)
        self._cond = threading.Condition()
        self._expected: deque[Hashable] = deque()  # scheduled, not acquired yet, in order
        self._unread: deque[Hashable] = deque()  # scheduled, read not started yet, in order
        self._free = list(range(slots))
        self._staged: dict[Hashable, _Staged] = {}  # read started (or done, or held)
        self._writes: dict[Hashable, Transfer] = {}  # written back, slot not free yet
        self._error: SwapIOError | None = None
        self._error_raised = False
        self._closed = False
        self.peak_in_use = 0

    @property
    def memory(self) -> torch.Tensor:
        """The host memory of every slot (one allocation), for counting what the host holds; never written
        through this."""
        return self._buffer

    @property
    def in_use(self) -> int:
        with self._cond:
            return self.slots - len(self._free)

    def schedule(self, keys: Iterable[Hashable]) -> None:
        """Append `keys` to the order of the coming acquires and start the reads that have a slot."""
        keys = list(keys)
        unknown = [key for key in keys if key not in self.files]
        if unknown:
            raise KeyError(f"schedule() got buckets without a swap file: {unknown}")
        with self._cond:
            self._check()
            self._expected.extend(keys)
            self._unread.extend(keys)
            self._pump()

    def acquire(self, key: Hashable) -> dict[str, torch.Tensor]:
        """The bucket's tensors in its slot, once read: views valid until `release(key)`."""
        with self._cond:
            self._check()
            if not self._expected or self._expected[0] != key:
                nxt = repr(self._expected[0]) if self._expected else "none (schedule() them first)"
                raise StagingOrderError(f"acquire({key!r}) out of order: the next scheduled bucket is {nxt}; acquire "
                                        f"buckets in the order given to schedule()")
            if key in self._staged and self._staged[key].held:
                raise StagingOrderError(f"acquire({key!r}) while bucket {key!r} is still held: release it before it "
                                        f"is read again")
            held = sum(staged.held for staged in self._staged.values())
            if key not in self._staged and held == self.slots:
                raise StagingOrderError(f"acquire({key!r}) while all {self.slots} staging slots are held: release a "
                                        f"bucket first (its read could never start)")
            deadline = time.monotonic() + self.timeout_s
            while True:
                self._check()
                staged = self._staged.get(key)
                if staged is not None and staged.read.done.is_set():
                    if staged.read.error is not None:  # set before `done`; _read_done may not have run yet
                        raise self._fail(staged.read.error)
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    path = self.files[key].path
                    what = "its read" if staged is not None else "a free slot for its read"
                    raise self._fail(SwapTimeoutError(f"bucket {key!r} ({path}) waited {self.timeout_s:g} s for "
                                                      f"{what} (a stalled or very slow disk under offload_dir)", path))
                self._cond.wait(left)
            self._expected.popleft()
            staged.held = True
            return self.files.layouts[key].views(self._slot_buffers[staged.slot])

    def release(self, key: Hashable, dirty: bool = True) -> None:
        """Give back the bucket's slot: written back to its file first when `dirty`, freed at once when not."""
        with self._cond:
            self._check()
            staged = self._staged.get(key)
            if staged is None or not staged.held:
                raise StagingOrderError(f"release({key!r}) of a bucket not held: acquire it first")
            del self._staged[key]
            if not dirty:
                self._free.append(staged.slot)
                self._pump()
                return
            nbytes = self.files.layouts[key].nbytes
            self._writes[key] = self._io.submit("write", self.files[key], self._slot_buffers[staged.slot], nbytes,
                                                on_done=lambda t, k=key, s=staged.slot: self._written(k, s, t))

    def flush(self) -> None:
        """Wait until every write-back started so far is on disk (within `timeout_s`), raising its failure: then
        the swap files of buckets not in a slot hold their newest values (a checkpoint may read them)."""
        with self._cond:
            self._check()
            deadline = time.monotonic() + self.timeout_s
            while self._writes:
                left = deadline - time.monotonic()
                if left <= 0:
                    path = next(iter(self._writes.values())).path
                    raise self._fail(SwapTimeoutError(f"flush(): the write-back of {path} did not finish within "
                                                      f"{self.timeout_s:g} s (a stalled or very slow disk under "
                                                      f"offload_dir)", path))
                self._cond.wait(left)
                self._check()

    def close(self) -> None:
        """Wait for the I/O in flight, then close and remove the swap files and their folder; raise an I/O failure
        not raised yet. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            in_flight = list(self._writes.values()) + [s.read for s in self._staged.values()]
        deadline = time.monotonic() + self.timeout_s
        timed_out = None
        for transfer in in_flight:
            if not transfer.done.wait(max(0.0, deadline - time.monotonic())):
                timed_out = SwapTimeoutError(f"close(): the {transfer.kind} of {transfer.path} did not finish within "
                                             f"{self.timeout_s:g} s; the swap folder is removed regardless",
                                             transfer.path)
                break
        self._io.shutdown(wait=timed_out is None)
        failed = [t.error for t in in_flight if t.done.is_set() and t.error is not None]  # on_done may not have run
        if timed_out is None:
            self.files.close()
        else:  # a thread may still be inside pread/pwrite on a file: closing its fd could let a new file take the
            self.files.folder.close()  # number under it; unlinked, the files go when the process's fds do
        with self._cond:
            if self._error is None and failed:
                self._error = failed[0]
            error = self._error if not self._error_raised else None
            self._error_raised = True
        if error is not None:
            raise error
        if timed_out is not None:
            raise timed_out

    # Below: with self._cond held (the callbacks take it on their I/O thread).

    def _check(self) -> None:
        if self._error is not None:
            self._error_raised = True
            raise self._error
        if self._closed:
            raise StagingOrderError("the disk staging is closed")

    def _fail(self, error: SwapIOError) -> SwapIOError:
        if self._error is None:
            self._error = error
        self._error_raised = True
        self._cond.notify_all()
        return error

    def _pump(self) -> None:
        """Start the next scheduled reads while slots are free, in order; a bucket still in a slot or being written
        back waits (its read would race its write), and so do the buckets after it."""
        while self._free and self._unread and not self._closed:
            key = self._unread[0]
            if key in self._staged or key in self._writes:
                return
            self._unread.popleft()
            slot = self._free.pop()
            read = self._io.submit("read", self.files[key], self._slot_buffers[slot], self.files.layouts[key].nbytes,
                                   on_done=self._read_done)
            self._staged[key] = _Staged(slot, read)
            self.peak_in_use = max(self.peak_in_use, self.slots - len(self._free))

    def _read_done(self, transfer: Transfer) -> None:
        with self._cond:
            if transfer.error is not None and self._error is None:
                self._error = transfer.error
            self._cond.notify_all()

    def _written(self, key: Hashable, slot: int, transfer: Transfer) -> None:
        with self._cond:
            del self._writes[key]
            if transfer.error is not None and self._error is None:
                self._error = transfer.error
            self._free.append(slot)
            self._pump()
            self._cond.notify_all()
