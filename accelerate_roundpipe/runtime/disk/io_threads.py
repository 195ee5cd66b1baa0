"""A small pool of I/O threads moving whole buckets between their swap files and staging slots, in chunks, so that
one bucket's read or write keeps several requests in flight (what an NVMe disk needs to reach its bandwidth).

A `Transfer` is one bucket's read or write: its chunks run on any of the threads, and it is done when all of them
are; its first error (wrapped to name the file) is kept for whoever waits, and `on_done` runs on the thread that
finished it. `hook(kind, path, offset, nbytes)` runs on the I/O thread before each chunk: tests inject delays and
errors there (off by default). `span(kind, path, offset, nbytes)`, when given, returns a context manager entered
around each chunk's system calls: the trace's "disk" track.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from .bucket_file import BucketFile
from .errors import SwapIOError, SwapTimeoutError

CHUNK_BYTES = 16 * 2**20
# Through the page cache a thread copies about 4-5 GB/s; 8 threads on 8 files wrote 33.7 GB/s on the H100 machine
# ([Note: swap files in pieces]). At least the 4 of before; more only up to one a core (the step's own threads run
# beside them), and 8 at most.
IO_THREADS = min(8, max(4, os.cpu_count() or 4))
Hook = Callable[[str, str, int, int], None]
Span = Callable[[str, str, int, int], contextlib.AbstractContextManager]


class Transfer:
    """One bucket's read or write in flight."""

    def __init__(self, kind: str, path: str, nbytes: int, chunks: int,
                 on_done: Callable[[Transfer], None] | None) -> None:
        self.kind, self.path, self.nbytes = kind, path, nbytes
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._left, self._mutex, self._on_done = chunks, threading.Lock(), on_done

    def _chunk_finished(self, error: BaseException | None) -> None:
        with self._mutex:
            if error is not None and self.error is None:
                self.error = error
            self._left -= 1
            last = self._left == 0
        if last:
            self.done.set()
            if self._on_done is not None:
                self._on_done(self)

    def wait(self, timeout_s: float) -> None:
        """Wait until done; raise its error, or SwapTimeoutError after `timeout_s`."""
        if not self.done.wait(timeout_s):
            raise SwapTimeoutError(f"the {self.kind} of {self.nbytes} bytes of {self.path} did not finish within "
                                   f"{timeout_s:g} s (a stalled or very slow disk under offload_dir)", self.path)
        if self.error is not None:
            raise self.error


class IOThreads:
    """`threads` daemon-free worker threads (joined at exit, so a write in flight completes)."""

    def __init__(self, threads: int | None = None, chunk_bytes: int = CHUNK_BYTES, hook: Hook | None = None,
                 span: Span | None = None) -> None:
        threads = IO_THREADS if threads is None else threads  # read now: a benchmark's switch sets it
        if threads < 1 or chunk_bytes < 1:
            raise ValueError(f"the disk tier needs at least one I/O thread and a positive chunk size, got "
                             f"threads={threads}, chunk_bytes={chunk_bytes}")
        self.chunk_bytes, self.hook, self.span = chunk_bytes, hook, span
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="roundpipe-disk-io")

    def submit(self, kind: str, file: BucketFile, buffer: torch.Tensor, nbytes: int,
               on_done: Callable[[Transfer], None] | None = None) -> Transfer:
        """Start reading (`kind="read"`: file -> buffer) or writing (`"write"`: buffer -> file) bytes [0, nbytes)."""
        if kind not in ("read", "write"):
            raise ValueError(f"a transfer is a 'read' or a 'write', not {kind!r}")
        # At least one chunk, so that on_done always runs on an I/O thread, never inside submit(); the pieces'
        # chunks in turn, so that the threads write different files at once ([Note: swap files in pieces]).
        chunks = file.chunks(nbytes, self.chunk_bytes)
        transfer = Transfer(kind, file.path, nbytes, len(chunks), on_done)
        for start, stop in chunks:
            self._pool.submit(self._chunk, transfer, file, buffer, start, stop)
        return transfer

    def _chunk(self, transfer: Transfer, file: BucketFile, buffer: torch.Tensor, start: int, stop: int) -> None:
        error = None
        try:
            if transfer.error is None:  # a chunk after a failed one would only add noise
                if self.hook is not None:
                    self.hook(transfer.kind, file.path, start, stop - start)
                move = file.read_range if transfer.kind == "read" else file.write_range
                span = self.span(transfer.kind, file.path, start, stop - start) if self.span is not None \
                    else contextlib.nullcontext()
                with span:
                    move(buffer, start, stop)
        except SwapIOError as failure:
            error = failure
        except BaseException as failure:  # noqa: B036 - whatever failed, the caller must hear of it, naming the file
            error = SwapIOError(f"the {transfer.kind} of bytes [{start}, {stop}) of {file.path} failed: "
                                f"{type(failure).__name__}: {failure}", file.path)
            error.__cause__ = failure
        transfer._chunk_finished(error)

    def shutdown(self, wait: bool) -> None:
        self._pool.shutdown(wait=wait, cancel_futures=not wait)

