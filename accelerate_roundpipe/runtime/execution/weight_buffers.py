"""The device buffers a worker uploads parameters into, kept from one task for a later one of the same shape.

[Note: weight buffers reused]
A task's parameters are uploaded into device buffers allocated when the task is taken or prefetched; before this
file they went back to torch's caching allocator when the task ended, marked for the compute stream that read them
(`record_stream`), so the allocator could hand them out again only once the GPU had run that task's last kernel.
The worker runs ahead of the GPU, and it prefetches the next task's parameters when a task starts: under a memory
cap the allocation for task k+2 (8.7 GiB a forward stage on Qwen3-30B-A3B LoRA under 24 GiB) came while task k was
still computing, found its memory not yet free, and the allocator's way out of that is to wait on the host for the
GPU (and give cached memory back to the driver), so the worker thread stood still and no kernel of task k+1 was
queued: the GPU went idle at every stage boundary.

Here a buffer outlives its task: when the task ends, its buffers come back with the compute-stream event that
follows its last kernel, and a later task whose bucket window has the same size and dtype (the same layer shape:
every decoder layer of a model, forward and backward stages alike) takes one and has the parameter-upload stream
wait for that event before the copy into it. The wait is on the GPU, so the worker thread never blocks and the
upload of task k+2 starts the moment task k is done, while task k+1 computes. A buffer is taken back only when its
task held the last reference to its memory (a tensor still viewing it, such as an autograd graph kept past the
task, leaves it to the caching allocator as before). Idle buffers stay at most `IDLE_TASKS` task ends and at most
the size of the largest task seen, so memory a pass no longer asks for goes back to the caching allocator.

[Note: idle buffers given back at the prefetch]
An idle buffer's use is a later task's allocation, made when a task starts and prefetches the next
(`ParamResidency.prefetch`). After that prefetch (and its look-ahead) the idle buffers held while the running task
computes are bounded by the plan: the device's allocated memory with them stays under what the measured plan
leaves a running task (`PassPlan.lookahead_limit_bytes`, the look-ahead's own bound), the oldest going back to the
caching allocator first; with no such limit (the unplanned first pass, CPU workers, the end of a pass) none stays.
The plan sizes a stage's activations in the memory the weights leave and knows nothing of buffers kept for later:
kept until they aged out, the buffers of a 22-layer forward stage (4.2 GiB, 20 of its 22 layer buffers not taken
by the fused stage after it) sat idle while that fused stage computed, and Qwen3-4B's full fine-tune at b8 under a
24 GiB cap, which trained at 20.9 GiB before buffers were reused, ran out of memory on its second pass (an H100,
ef07843: 22.9 GiB allocated, 594 MiB asked). Within the limit they stay: a look-ahead whose memory must come from
the caching allocator can wait there for the GPU, which is what reusing buffers avoids.
"""

from __future__ import annotations

import collections

import torch

from ...compat.torch_internals import storage_use_count

IDLE_TASKS = 4  # task ends an unused buffer is kept for before it goes back to the caching allocator


class WeightBuffers:
    """One worker's reusable parameter buffers; used by its thread only."""

    def __init__(self) -> None:
        self._idle: dict[tuple, collections.deque] = collections.defaultdict(collections.deque)
        self._task = 0  # task ends seen: the age of an idle buffer
        self._idle_bytes = 0
        self._limit_bytes = 0  # the largest task's parameter bytes seen so far
        self.reused = self.returned = 0  # buffers handed out again / taken back (tests and traces read them)

    @staticmethod
    def _key(numel: int, dtype: torch.dtype) -> tuple:
        return (numel, dtype)

    def take(self, numel: int, dtype: torch.dtype):
        """An idle buffer of `numel` elements of `dtype` and the event its last task's kernels end at (the upload
        into it waits for it), or None when there is none."""
        idle = self._idle.get(self._key(numel, dtype))
        if not idle:
            return None
        buffer, event, _ = idle.popleft()
        self._idle_bytes -= buffer.numel() * buffer.element_size()
        self.reused += 1
        return buffer, event

    def give(self, buffers: list[torch.Tensor], event) -> None:
        """Take back a finished task's buffers, free once the compute stream passes `event`; drop buffers idle
        too long or beyond the size limit (their memory goes back to the caching allocator)."""
        self._task += 1
        self._limit_bytes = max(self._limit_bytes, sum(b.numel() * b.element_size() for b in buffers))
        for buffer in buffers:
            # 2: `buffer` itself and the storage object asked; any other tensor on this memory keeps it out.
            if buffer._base is not None or storage_use_count(buffer) != 2:
                continue
            self._idle[self._key(buffer.numel(), buffer.dtype)].append((buffer, event, self._task))
            self._idle_bytes += buffer.numel() * buffer.element_size()
            self.returned += 1
        self._trim()

    def _trim(self) -> None:
        oldest_kept = self._task - IDLE_TASKS
        # by age alone: two keys of one age may differ only by dtype, which has no order
        entries = sorted(((task, key) for key, idle in self._idle.items() for _, _, task in idle),
                         key=lambda entry: entry[0])
        for task, key in entries:
            if task > oldest_kept and self._idle_bytes <= self._limit_bytes:
                break
            buffer, _, _ = self._idle[key].popleft()  # each deque is in task order: its head is this entry
            self._idle_bytes -= buffer.numel() * buffer.element_size()
        for key in [key for key, idle in self._idle.items() if not idle]:
            del self._idle[key]

    def trim_to(self, allowed_bytes: float) -> None:
        """Give the oldest idle buffers back to the caching allocator until at most `allowed_bytes` stay idle
        ([Note: idle buffers given back at the prefetch])."""
        while self._idle_bytes > allowed_bytes:
            _, key = min(((idle[0][2], key) for key, idle in self._idle.items() if idle), key=lambda e: e[0])
            buffer, _, _ = self._idle[key].popleft()
            self._idle_bytes -= buffer.numel() * buffer.element_size()
            if not self._idle[key]:
                del self._idle[key]

    def clear(self) -> None:
        """Give every idle buffer back to the caching allocator (the device is closing or memory is short)."""
        self._idle.clear()
        self._idle_bytes = 0

    @property
    def idle_bytes(self) -> int:
        return self._idle_bytes
