"""The default host-memory budget: what the engine may keep in host memory before optimizer state goes to disk.

[Note: default host memory budget]
The budget is the memory available when the engine is built (Linux's MemAvailable in /proc/meminfo: free memory
plus the page cache and reclaimable caches the kernel can give back; elsewhere the free pages `os.sysconf`
reports), less a headroom of `HEADROOM_SHARE` of it, and at least `MIN_HEADROOM_GIB`, for what is not the engine's
state: activations saved on the host, the data loader and tokenizer, Python and the libraries, the page cache the
swap files' own reads and writes go through. On a 128 GB machine with 120 GiB available that is 96 GiB.
"""

from __future__ import annotations

import os

GiB = 2**30
HEADROOM_SHARE = 0.2
MIN_HEADROOM_GIB = 4.0


def available_memory_bytes(meminfo: str = "/proc/meminfo") -> int:
    """Host memory available for new allocations, in bytes."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the kernel writes kB (KiB)
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_host_memory_budget(available_bytes: int | None = None) -> float:
    """The default `host_memory_budget` in GiB, from `available_bytes` (measured when not given)."""
    available = available_memory_bytes() if available_bytes is None else available_bytes
    headroom = max(MIN_HEADROOM_GIB * GiB, HEADROOM_SHARE * available)
    return max(0.0, (available - headroom) / GiB)
