"""What one task hands to another (`Payload`), and what a device that records no kernel timing gives instead:
a host-clock timer and a span that is not recorded."""

from __future__ import annotations

import time


def _nothing() -> None:
    pass


NO_SPAN = (_nothing, _nothing)  # the (begin, finish) of a span that is not recorded


class Payload:
    """Tensors one task hands to another: on the host (readable once `event` completed), or still on the device of
    worker `worker_index` when the consumer is that same worker (same stream: no copy, no wait)."""

    __slots__ = ("tensors", "event", "worker_index", "lease")

    def __init__(self, tensors: tuple, event=None, worker_index: int | None = None, lease=None) -> None:
        self.tensors = tensors
        self.event = event
        self.worker_index = worker_index
        # Host tensors in pooled blocks: told the upload that reads them back ([Note: saved inputs in pooled blocks])
        self.lease = lease

    def host(self) -> tuple:
        """The tensors, once readable by the CPU."""
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        return self.tensors


class WallTimer:
    """Times a layer run on the host clock (a device whose work is done when the call returns)."""

    __slots__ = ("start", "seconds")

    def __init__(self) -> None:
        self.start, self.seconds = time.perf_counter(), None

    def stop(self) -> None:
        self.seconds = time.perf_counter() - self.start

    def elapsed_s(self) -> float:
        return self.seconds
