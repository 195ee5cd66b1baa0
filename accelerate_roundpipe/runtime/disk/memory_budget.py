"""The default host-memory budget: what the engine may keep in host memory before optimizer state goes to disk.

[Note: default host memory budget]
The budget is the memory available when the engine is built (Linux's MemAvailable in /proc/meminfo: free memory
plus the page cache and reclaimable caches the kernel can give back; elsewhere the free pages `os.sysconf`
reports; in a container with a memory limit, at most the limit less what the container uses beyond its inactive
page cache, from the cgroup files at /sys/fs/cgroup, v2 or v1: MemAvailable there is the whole host's), less a
headroom of `HEADROOM_SHARE` of it, and at least `MIN_HEADROOM_GIB`, for what is not the engine's
state: activations saved on the host, the data loader and tokenizer, Python and the libraries, the page cache the
swap files' own reads and writes go through. On a 128 GB machine with 120 GiB available that is 96 GiB.
"""

from __future__ import annotations

import os

GiB = 2**30
HEADROOM_SHARE = 0.2
MIN_HEADROOM_GIB = 4.0


UNLIMITED = 2**60  # cgroup v1 writes "no limit" as a number near 2**63


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _stat_field(text: str | None, *names: str) -> int:
    for line in (text or "").splitlines():
        key, _, value = line.partition(" ")
        if key in names:
            return int(value)
    return 0


def cgroup_available_bytes(root: str = "/sys/fs/cgroup") -> int | None:
    """What this container's memory limit leaves: the limit less the usage beyond the inactive page cache (which
    the kernel reclaims first); None without a limit."""
    for limit_file, usage_file, stat_file, inactive in (
            ("memory.max", "memory.current", "memory.stat", ("inactive_file",)),  # cgroup v2
            ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory/memory.stat",
             ("total_inactive_file", "inactive_file"))):  # cgroup v1
        limit, usage = _read(os.path.join(root, limit_file)), _read(os.path.join(root, usage_file))
        if limit is None or usage is None:
            continue
        if limit.strip() == "max" or int(limit) >= UNLIMITED:
            return None
        used = int(usage) - _stat_field(_read(os.path.join(root, stat_file)), *inactive)
        return max(0, int(limit) - used)
    return None


def available_memory_bytes(meminfo: str = "/proc/meminfo", cgroup_root: str = "/sys/fs/cgroup") -> int:
    """Host memory available for new allocations, in bytes."""
    text = _read(meminfo)
    available = next((int(line.split()[1]) * 1024 for line in (text or "").splitlines()
                      if line.startswith("MemAvailable:")), None)  # the kernel writes kB (KiB)
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limited = cgroup_available_bytes(cgroup_root)
    return available if limited is None else min(available, limited)


def default_host_memory_budget(available_bytes: int | None = None) -> float:
    """The default `host_memory_budget` in GiB, from `available_bytes` (measured when not given)."""
    available = available_memory_bytes() if available_bytes is None else available_bytes
    headroom = max(MIN_HEADROOM_GIB * GiB, HEADROOM_SHARE * available)
    return max(0.0, (available - headroom) / GiB)


def resident_memory_bytes(statm: str = "/proc/self/statm") -> int | None:
    """This process's resident memory now, in bytes (Linux's /proc/self/statm: its second field, in pages); None
    where that file cannot be read."""
    text = _read(statm)
    try:
        return int(text.split()[1]) * os.sysconf("SC_PAGE_SIZE") if text else None
    except (IndexError, ValueError):
        return None
