"""The collective streams of a data-parallel group: daemon threads, one per extra gloo group, that run the chunks
of one collective at once ([Note: data parallel], Streams), and the handle a waiting thread holds."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class CollectiveStreams:
    """Daemon threads, one per extra gloo group, that run the chunks of one collective at once; a chunk stuck on a
    failed peer is left to gloo's timeout (the threads are daemons: they never hold the process up), but the
    process waits for it at exit ([Note: clean exit under data parallelism])."""

    def __init__(self, count: int) -> None:
        import queue

        self._queues = [queue.SimpleQueue() for _ in range(count)]
        self._threads = [threading.Thread(target=self._serve, args=(jobs,), name=f"roundpipe-collective-stream-{i}",
                                          daemon=True) for i, jobs in enumerate(self._queues)]
        for thread in self._threads:
            thread.start()

    @staticmethod
    def _serve(jobs) -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            job()
            del job  # an idle stream holds no tensor ([Note: clean exit under data parallelism])

    def start(self, chunks: list[Callable[[], Any]]) -> CollectiveHandle:
        """Start `chunks[k]` on stream k, all at once (each stream runs what it gets in order)."""
        handle = CollectiveHandle(len(chunks))
        for k, chunk in enumerate(chunks):
            self._queues[k].put(handle.job(chunk))
        return handle

    def stop(self) -> None:
        for jobs in self._queues:
            jobs.put(None)

    def join(self, timeout_s: float) -> bool:
        """After `stop()`: wait (at most `timeout_s` in all) until every stream thread ended; whether all did."""
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in self._threads)


class CollectiveHandle:
    """One collective running on the streams: finished once every chunk ended; `error` the first one raised."""

    def __init__(self, num_chunks: int) -> None:
        self._left = num_chunks
        self._lock = threading.Lock()
        self.finished = threading.Event()
        self.error: BaseException | None = None

    def job(self, chunk: Callable[[], Any]) -> Callable[[], None]:
        def run_chunk() -> None:
            try:
                chunk()
            except BaseException as error:  # noqa: BLE001 - handed to the waiting thread
                with self._lock:  # two chunks failing at once: the first error is kept
                    self.error = self.error or error
            finally:
                with self._lock:
                    self._left -= 1
                    if self._left == 0:
                        self.finished.set()
        return run_chunk


def join_at_exit(streams: CollectiveStreams, timeout_s: float) -> None:
    if not streams.join(timeout_s + 5.0):
        logger.warning("RoundPipe: a data-parallel collective was still waiting on a peer %.0f s after exit began; "
                       "exiting anyway.", timeout_s + 5.0)
