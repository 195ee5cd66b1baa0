"""A smaller host, emulated: another process holds memory so that this one sees `available_gib` available.

The disk tier exists for machines whose host memory cannot hold the optimizer state (a 64 GB workstation), but the
lent GPU machines have 128 GB: a run with most state on disk leaves the rest of that memory to the kernel's page
cache, which then holds the swap files, and the disk is hardly read. As `set_per_process_memory_fraction` emulates a
24 GiB card, the ballast emulates the smaller host: a child process allocates and touches the difference between
what is available and `available_gib`, and holds it until the benchmark ends (its stdin closes when the parent exits,
also when the parent is killed). It lives in its own process so the benchmark's own peak resident memory (VmHWM)
stays the engine's.
"""

from __future__ import annotations

import subprocess
import sys
from contextlib import contextmanager

from accelerate_roundpipe.runtime.disk import available_memory_bytes

GiB = 2**30

# The child: allocate and touch the bytes in 1 GiB pieces (every page resident), say so, then wait for EOF.
_CHILD = """
import sys
pieces, left = [], int(sys.argv[1])
while left > 0:
    n = min(left, 1 << 30)
    pieces.append(bytearray(b"\\x01") * n)
    left -= n
print("ready", flush=True)
sys.stdin.read()
"""


def ballast_bytes(available: int, available_gib: float) -> int:
    """What the ballast must hold for `available_gib` GiB to stay available out of `available` bytes."""
    return max(0, int(available - available_gib * GiB))


@contextmanager
def host_ballast(available_gib: float | None):
    """Hold memory in a child process so that about `available_gib` GiB stay available; yields the bytes held (0
    when `available_gib` is None or not below what is available)."""
    if available_gib is None:
        yield 0
        return
    held = ballast_bytes(available_memory_bytes(), available_gib)
    if held == 0:
        yield 0
        return
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(held)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        if child.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the host ballast of {held / GiB:.1f} GiB did not start (exit {child.wait()}); "
                               f"raise --host-available-gib")
        yield held
    finally:
        child.stdin.close()
        child.wait(timeout=60)
