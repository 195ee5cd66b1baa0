"""Test hook: a callable run at named points of the runtime (to inject delays or errors). Off by default.

Points: "worker.task" (a worker starts a task), "transfer.upload", "transfer.download", "commit" (gradients added to
the host), "optimizer.step", "optimizer.writeback", and on the caller's thread "dispatch.enqueue" (a task's tickets
reserved, the task not queued yet).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

POINTS = ("worker.task", "transfer.upload", "transfer.download", "commit", "optimizer.step", "optimizer.writeback",
          "dispatch.enqueue")
Hook = Callable[[str], None]
_hook: Hook | None = None


def point(name: str) -> None:
    if _hook is not None:
        _hook(name)


@contextlib.contextmanager
def injected(hook: Hook) -> Iterator[None]:
    """Run `hook(point_name)` at every fault point inside the block."""
    global _hook
    previous, _hook = _hook, hook
    try:
        yield
    finally:
        _hook = previous


def raise_at(point: str, occurrence: int, make_error: Callable[[str], BaseException]) -> Hook:
    """A hook raising `make_error(message)` the `occurrence`-th time (1-based) `point` is reached."""
    seen = 0

    def hook(name: str) -> None:
        nonlocal seen
        if name == point:
            seen += 1
            if seen == occurrence:
                raise make_error(f"injected fault at {point} #{occurrence}")

    return hook
