"""Page-locked host blocks for the layer inputs a pass saves for its backward, reused once the copy that last touched
them has completed.

[Note: saved inputs in pooled blocks]
A saved layer input crosses to the host after its forward and back to a device for its stage's recomputation
([Note: saved inputs]). By default it goes through torch's caching host allocator
(`tensor.to("cpu", non_blocking=True)`), which rounds every block up to a power of two: Qwen3-4B's 80 MiB inputs of
4 rows take 128 MiB each, Qwen3-32B's 160 MiB take 256, several GiB of page-locked memory a pass for nothing; and
the setting that turns the rounding off is unsafe alone ([Note: unrounded page-locked blocks] in
runtime/devices/pinned.py). Here the blocks come from the store's `HostMemory` (page-locked in place,
[Note: exact-size pinned memory]) in size classes of `1 / SIZE_STEPS` of an octave, so a block is at most an eighth
larger than what it holds, and inputs whose sizes differ a little (the last micro-batch's fewer rows, a batch padded
a few tokens longer) still share blocks. A request takes the smallest ready free block of its size or larger before
a new block is made. Where sizes grow from pass to pass (a batch padded to its longest row, a sequence-length
schedule) a block made at the exact size would be outgrown by the next pass and stranded, so a new block is made at
the next power of two whenever smaller free blocks show that growth, as torch's cache makes every block; what
growing sizes cost beyond torch's cache is then at most the exact blocks made before the growth showed. Modelled
over 1,000 passes of 72 inputs of 4 rows x L tokens x 2,560 (Qwen3-4B's): at a fixed L the pool holds 0.63x what
torch's cache holds, with L growing from 300 to 1,024 or drawn at random from that range 1.11x, from 64 to 4,096 at
random 0.76x (`tests/test_saved_input_buffers.py` keeps a model of torch's cache).

The activations one worker hands to a task on another worker (several GPUs) take the same path: one `receive`
reads each back, so they use the same blocks (`Worker._send_next`); what the caller reads (a pass's outputs and
losses) stays in torch's cache, as the caller may keep it.

When a block is free again: its payload's tensors are views of it, each with a finalizer that gives the block back
when the view is collected, after the backward's upload has been queued from it, or when a failed pass drops it
unread. The block goes back with the last event of the copies that touched it (its download, then its upload:
`Lease`), and is handed out again only once that event has completed (`event.query()`), so a new download never
writes into a block an upload may still be reading, on whichever device or stream. Nothing waits for the GPU.

Off by default (`POOLED`) until `bash scripts/device/bench.sh saved-input-blocks` has measured it on a GPU beside
torch's cache; the tests turn it on.

Free blocks stay for the next pass, as torch's cache kept them. After the measured pass, whose partition saves
every layer's input, the blocks nobody holds go back with torch's (`release_idle`,
[Note: the measured pass's pinned blocks released]), and all of them at `close()`.
"""

from __future__ import annotations

import collections
import threading
import weakref

import torch

from ..devices.pinned import HostMemory

# Saved inputs in this pool; False: torch's caching host allocator, as before. Off until measured on a GPU
# (`bench.sh saved-input-blocks`): the pool is exact on CPU workers and the stream model, and has not run on CUDA yet.
POOLED = False
SIZE_STEPS = 8  # size classes per octave: a block holds at least 8/9 of its bytes
MIN_BLOCK = 4096


def block_size(nbytes: int) -> int:
    """The block that holds `nbytes`: the next multiple of an eighth of the octave `nbytes` is in (a power of two
    exactly fits), at least `MIN_BLOCK`."""
    if nbytes <= MIN_BLOCK:
        return MIN_BLOCK
    octave = 1 << (nbytes - 1).bit_length()  # the power of two at or above nbytes
    step = octave // (2 * SIZE_STEPS)  # the octave is (octave / 2, octave]: SIZE_STEPS steps of this
    return -(-nbytes // step) * step


class Lease:
    """The copies that touch one payload's blocks: `event` is the last of them (the download, then the upload that
    reads them back); the blocks are reused once it has completed."""

    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event = None

    def touched_by(self, event) -> None:
        self.event = event


class SavedInputBuffers:
    """Page-locked blocks for saved layer inputs ([Note: saved inputs in pooled blocks]). Shared by the workers
    (a backward may read an input another worker saved); every change goes through the lock. The finalizers that
    give blocks back run on whichever thread drops a payload, and may run inside the garbage collector at any
    allocation, this pool's own included, while that thread holds the lock: so they take no lock and only append
    to `_returned` (a deque's append is atomic), which the next holder of the lock files back."""

    def __init__(self, memory: HostMemory) -> None:
        self.memory = memory
        self._free: dict[int, list[tuple[torch.Tensor, object]]] = {}  # block size -> (block, its last event)
        self._returned: collections.deque[tuple[torch.Tensor, object]] = collections.deque()
        self._lock = threading.Lock()
        self.bytes = 0  # every block made and not let go of (free or held by a payload)
        self._out_bytes = 0  # blocks held by payloads, less those in `_returned`
        self.peak_bytes = 0  # the most `bytes` so far
        self.allocated = 0  # blocks made so far: flat in the steady state, when every input reuses one

    def _file_returned(self) -> None:
        """Under the lock: the blocks finalizers gave back, into the free lists."""
        while self._returned:
            block, event = self._returned.popleft()
            self._out_bytes -= block.numel()
            self._free.setdefault(block.numel(), []).append((block, event))

    @property
    def out_bytes(self) -> int:
        """Blocks held by payloads."""
        with self._lock:
            self._file_returned()
            return self._out_bytes

    @staticmethod
    def block_size(nbytes: int) -> int:
        """The block this pool takes for `nbytes` (`block_size`)."""
        return block_size(nbytes)

    def lease(self) -> Lease:
        return Lease()

    def host_copy_target(self, like: torch.Tensor, lease: Lease) -> torch.Tensor:
        """A host tensor shaped and typed like `like` (contents undefined) in a block of this pool; the block comes
        back when the tensor is collected, with `lease`'s event at that time."""
        nbytes = like.numel() * like.element_size()
        block = self._take(block_size(nbytes))
        view = block[:nbytes].view(like.dtype).view(like.shape)
        weakref.finalize(view, self._give, block, lease).atexit = False
        return view

    def _take(self, size: int) -> torch.Tensor:
        """The smallest ready free block of `size` or larger, else a new one: of `size`, or of the next power of two
        where free blocks smaller than `size` show the sizes growing from pass to pass (a batch padded to its longest
        row, a sequence-length schedule), so that later, larger inputs reuse it as they would in torch's cache
        instead of stranding a block of every size on the way ([Note: saved inputs in pooled blocks])."""
        with self._lock:
            self._file_returned()
            growing = False
            for held in sorted(self._free):
                free = self._free[held]
                if held < size:
                    growing = growing or bool(free)
                    continue
                for index, (block, event) in enumerate(free):
                    if event is None or event.query():  # no copy can still read or write it
                        del free[index]
                        self._out_bytes += held
                        return block
            if growing:
                size = max(size, 1 << (size - 1).bit_length())
            self.allocated += 1
            self.bytes += size
            self._out_bytes += size
            self.peak_bytes = max(self.peak_bytes, self.bytes)
        return self.memory.empty(size, torch.uint8)

    def _give(self, block: torch.Tensor, lease: Lease) -> None:
        self._returned.append((block, lease.event))  # no lock: see the class's docstring

    def free_bytes(self) -> int:
        with self._lock:
            self._file_returned()
            return sum(size * len(blocks) for size, blocks in self._free.items())

    def release_idle(self) -> int:
        """Let go of the free blocks (unlocked first: [Note: unlock before free]); blocks held by payloads stay.
        Returns the bytes let go of. Waits for the devices, as `HostMemory.give_back` does: call it between passes,
        where the measured pass's blocks go back."""
        with self._lock:
            self._file_returned()
            idle = [block for blocks in self._free.values() for block, _ in blocks]
            self._free.clear()
            freed = sum(block.numel() for block in idle)
            self.bytes -= freed
        if idle:
            self.memory.give_back(*idle)
        return freed

    def release(self) -> None:
        """The engine closed ([Note: memory freed at close]): the free blocks go; the store's `HostMemory` unlocks
        every block it locked."""
        with self._lock:
            self._file_returned()
            self._free.clear()
            self.bytes = self._out_bytes
