"""A stand-in for the CUDA runtime's host-memory locks (`pinned.CudaHostLocks`): the locking tests run on CPU
workers and read what would have been locked."""

from __future__ import annotations


class RecordedLocks:
    """What `CudaHostLocks` would lock and unlock, by data pointer."""

    def __init__(self):
        self.locked: dict[int, int] = {}
        self.unlocked: list[int] = []

    def lock(self, buffer):
        assert buffer.data_ptr() not in self.locked, "locked twice: CUDA refuses it"
        self.locked[buffer.data_ptr()] = buffer.numel() * buffer.element_size()

    def unlock(self, buffers):
        for buffer in buffers:
            self.unlocked.append(buffer.data_ptr())
            del self.locked[buffer.data_ptr()]
        return True
