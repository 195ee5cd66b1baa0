"""The disk's own sequential bandwidth, measured in the offload folder: what the disk tier's reads and writes are
compared with (the start summary, the benchmark).

The probe writes `nbytes` in `block_bytes` blocks of random bytes (a compressing filesystem would flatter zeros),
fsyncs (the time includes reaching the disk, not only the page cache), asks the kernel to drop the file's cached
pages (`POSIX_FADV_DONTNEED`, so that the read comes from the disk), reads it back, and removes the file. On tmpfs the
"disk" is memory and both rates are memory's.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from .bucket_file import byte_view, read_at, write_at

PROBE_BYTES = 256 * 2**20
BLOCK_BYTES = 8 * 2**20


@dataclass(frozen=True)
class DiskBandwidth:
    """Sequential rates in GB/s (10^9 bytes a second) of `nbytes` written and read back in `folder`."""

    write_gbps: float
    read_gbps: float
    nbytes: int
    folder: str

    def __str__(self) -> str:
        return (f"disk {self.folder}: write {self.write_gbps:.2f} GB/s, read {self.read_gbps:.2f} GB/s "
                f"({self.nbytes / 2**20:.0f} MiB sequential)")


def probe_bandwidth(folder: str, nbytes: int = PROBE_BYTES, block_bytes: int = BLOCK_BYTES) -> DiskBandwidth:
    """Measure sequential write and read bandwidth of `nbytes` in `folder` (the file is removed after)."""
    if nbytes < 1 or block_bytes < 1:
        raise ValueError(f"the bandwidth probe needs positive sizes, got nbytes={nbytes}, block_bytes={block_bytes}")
    block_bytes = min(block_bytes, nbytes)
    block = torch.randint(0, 256, (block_bytes,), dtype=torch.uint8)
    data = byte_view(block)
    path = os.path.join(folder, f".roundpipe-bandwidth-{os.getpid()}-{time.monotonic_ns()}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        start = time.perf_counter()
        for offset in range(0, nbytes, block_bytes):
            write_at(fd, data[:min(block_bytes, nbytes - offset)], offset, path)
        os.fsync(fd)
        write_s = time.perf_counter() - start
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # after fsync the pages are clean and can be dropped
        start = time.perf_counter()
        for offset in range(0, nbytes, block_bytes):
            read_at(fd, data[:min(block_bytes, nbytes - offset)], offset, path)
        read_s = time.perf_counter() - start
    finally:
        os.close(fd)
        os.unlink(path)
    return DiskBandwidth(nbytes / 1e9 / max(write_s, 1e-9), nbytes / 1e9 / max(read_s, 1e-9), nbytes, folder)
