"""[Note: unlock before free]: every page-locked host buffer is unlocked before its memory can be freed, whether
its engine was closed or only collected. The CUDA runtime is replaced by a recorder here; the GPU test
(`integration_tests/test_gpu_engines_in_turn.py`) runs the real one."""

from __future__ import annotations

import gc

import torch

from accelerate_roundpipe.runtime.devices.pinned import HostMemory


class RecordingLocks:
    """Stands in for `CudaHostLocks`: records which addresses are locked, and fails when one is locked twice (what
    cudaHostRegister answers when a freed locked range is handed out again)."""

    def __init__(self) -> None:
        self.locked: dict[int, int] = {}
        self.unlocked: list[int] = []

    def lock(self, buffer: torch.Tensor) -> None:
        start, size = buffer.data_ptr(), buffer.numel() * buffer.element_size()
        for other, other_size in self.locked.items():
            if start < other + other_size and other < start + size:
                raise RuntimeError("part or all of the requested memory range is already mapped")
        self.locked[start] = size

    def unlock(self, buffers: list[torch.Tensor]) -> bool:
        for buffer in buffers:
            del self.locked[buffer.data_ptr()]
            self.unlocked.append(buffer.data_ptr())
        return True


def _fill(memory: HostMemory) -> list[int]:
    buffers = [memory.zeros(2**20 + k, torch.float32) for k in range(4)]  # large: the allocator maps them apart
    return [b.data_ptr() for b in buffers]


def test_collected_memory_is_unlocked_before_it_is_freed():
    locks = RecordingLocks()
    memory = HostMemory(pinned=True, locks=locks)
    addresses = _fill(memory)
    assert sorted(locks.locked) == sorted(addresses) and memory.locked_bytes == sum(4 * (2**20 + k) for k in range(4))
    del memory  # no release(): an engine a Trainer left open, then collected
    gc.collect()
    assert locks.locked == {} and sorted(locks.unlocked) == sorted(addresses)


def test_memories_in_turn_never_lock_a_range_twice():
    locks = RecordingLocks()
    for _ in range(6):  # engines built and dropped in turn, as a notebook or a sweep does
        memory = HostMemory(pinned=True, locks=locks)
        _fill(memory)
        del memory
        gc.collect()
    assert locks.locked == {}


def test_release_unlocks_once_and_the_buffers_stay_valid():
    locks = RecordingLocks()
    memory = HostMemory(pinned=True, locks=locks)
    buffer = memory.zeros(1000, torch.float32).add_(3)
    memory.release()
    assert locks.locked == {} and memory.locked_bytes == 0 and torch.equal(buffer, torch.full((1000,), 3.0))
    del memory
    gc.collect()
    assert len(locks.unlocked) == 1  # the finalizer found nothing left to unlock


def test_unpinned_memory_locks_nothing():
    locks = RecordingLocks()
    memory = HostMemory(pinned=False, locks=locks)
    _fill(memory)
    assert locks.locked == {} and memory.locked_bytes == 0


def test_buffers_given_back_are_unlocked_and_the_others_stay_locked():
    """A bucket whose optimizer copy and gradient moved to its device gives their host buffers back
    ([Note: optimizer placement]): those are unlocked, the rest stay locked until release."""
    locks = RecordingLocks()
    memory = HostMemory(pinned=True, locks=locks)
    buffers = [memory.zeros(2**20 + k, torch.float32) for k in range(4)]
    memory.give_back(buffers[1], None, buffers[3])
    assert locks.unlocked == [buffers[1].data_ptr(), buffers[3].data_ptr()]
    assert set(locks.locked) == {buffers[0].data_ptr(), buffers[2].data_ptr()}
    assert memory.locked_bytes == sum(b.numel() * b.element_size() for b in (buffers[0], buffers[2]))
    memory.release()
    assert not locks.locked


def test_the_unsafe_page_locked_cache_setting_is_named_and_the_safe_ones_pass():
    """[Note: unrounded page-locked blocks]: `pinned_max_round_threshold_mb` without `pinned_max_cached_size_mb` at or
    below it lets torch's page-locked cache hand a copy a smaller block; the start warns, naming what to change."""
    from accelerate_roundpipe.runtime.devices.pinned import unrounded_pinned_cache_hazard

    assert unrounded_pinned_cache_hazard({}) is None
    assert unrounded_pinned_cache_hazard({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}) is None
    unsafe = unrounded_pinned_cache_hazard({"PYTORCH_ALLOC_CONF": "pinned_max_round_threshold_mb:40"})
    assert unsafe is not None and "pytorch/pytorch#192722" in unsafe
    assert "add pinned_max_cached_size_mb:40" in unsafe and "Remove pinned_max_round_threshold_mb" in unsafe
    assert unrounded_pinned_cache_hazard(
        {"PYTORCH_CUDA_ALLOC_CONF": "pinned_max_round_threshold_mb:64,pinned_max_cached_size_mb:128"}) is not None
    assert unrounded_pinned_cache_hazard(
        {"PYTORCH_ALLOC_CONF": "pinned_max_round_threshold_mb:64, pinned_max_cached_size_mb:64"}) is None
    # torch reads PYTORCH_ALLOC_CONF when it is set, the older name only otherwise
    assert unrounded_pinned_cache_hazard({"PYTORCH_CUDA_ALLOC_CONF": "pinned_max_cached_size_mb:8",
                                          "PYTORCH_ALLOC_CONF": "pinned_max_round_threshold_mb:64"}) is not None
    assert unrounded_pinned_cache_hazard({"PYTORCH_CUDA_ALLOC_CONF": "pinned_max_round_threshold_mb:64",
                                          "PYTORCH_ALLOC_CONF": "expandable_segments:True"}) is None
