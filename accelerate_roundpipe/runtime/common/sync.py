"""Waiting primitives shared by the worker threads, the optimizer thread and the caller.

Every wait polls a shared `FailureFlag`, so a failure in any thread wakes every waiter within a poll interval and
is re-raised where it is waited on; a wait longer than the configured timeout raises instead of hanging.

[Note: per-layer events]
The host store's buffers are guarded by tickets reserved by the caller thread in program order, when work is
enqueued, and executed later by whichever thread does the work:
- compute copies use a `ReadWriteOrder`: reads reserved between two writes may run in any order and together; a
  write waits for every earlier write and every read reserved before it. So an upload never reads a half-written
  copy and always reads exactly the version its iteration is entitled to (staleness rule of `LaggedOptimizer`).
- gradient buffers use a `Sequencer`: commits, the step's read and zeroing run strictly in reservation order. So a
  step never reads gradients still being accumulated, gradients of the next iteration never land in a buffer the
  step still reads, and the summation order (hence every bit of the result) does not depend on thread timing.
All waits point to work reserved earlier, and each thread runs its own work in reservation order, so the earliest
unfinished piece of work can always proceed: no deadlock.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

POLL_S = 0.05


class EngineClosedError(RuntimeError):
    """The engine stopped after an error in one of its threads (or was closed)."""


_engine_thread = threading.local()


def mark_engine_thread() -> None:
    """Called by worker and optimizer threads: their failed waits abort quietly instead of reporting."""
    _engine_thread.active = True


class ReportedError(RuntimeError):
    """What a `FailureFlag` keeps of an error once the caller has seen it: its type and message."""


class InterruptedReservationError(EngineClosedError):
    """The caller was interrupted (e.g. Ctrl-C) while it reserved tickets of [Note: per-layer events]."""


class Aborted(Exception):
    """Raised inside engine threads when another thread already failed; never reaches the user."""


class FailureFlag:
    """The first error raised in any engine thread; every wait checks it."""

    def __init__(self, timeout_s: float = 600.0) -> None:
        self.timeout_s = timeout_s
        self.error: BaseException | None = None
        self.where: str = ""
        self.closed = False
        self._reported = False
        self._lock = threading.Lock()

    def fail(self, error: BaseException, where: str) -> None:
        with self._lock:
            if self.error is None and not isinstance(error, Aborted):
                self.error = error
                self.where = where

    def fail_here(self, error: BaseException, where: str) -> None:
        """The caller's own failure that must close the engine too (e.g. a collective across data-parallel
        processes): recorded as reported, since the caller raises it itself now."""
        self.fail(error, where)
        with self._lock:
            self._reported = True

    def close(self) -> None:
        self.closed = True

    @property
    def running(self) -> bool:
        """No thread failed and the engine is not closed: queued work may run (else it is skipped, cancelled)."""
        return self.error is None and not self.closed

    def check(self) -> None:
        """Raise if the engine failed: in the caller, the original error once, then `EngineClosedError`."""
        if self.error is None and not self.closed:
            return
        if getattr(_engine_thread, "active", False):
            raise Aborted(self.where)
        if self.error is not None:
            with self._lock:
                first, self._reported = not self._reported, True
                error = self.error
                if first:
                    # Keep only its text from now on: raised here, the error's traceback gains the caller's frames
                    # (which hold the engine), and the flag is reachable from the engine's threads and finalizer,
                    # so holding the error would keep a failed engine, its host store included, alive for good.
                    self.error = ReportedError(f"{type(error).__name__}: {error}")
            if first:
                error.add_note(f"[RoundPipe] raised in {self.where}; the engine is now closed.")
                raise error
            raise EngineClosedError(
                f"the RoundPipe engine stopped after an error in {self.where}: {type(self.error).__name__}: "
                f"{self.error}. Build a new engine to continue.") from self.error
        raise EngineClosedError("the RoundPipe engine is closed; build a new one to continue.")

    @contextlib.contextmanager
    def reserving(self, what: str) -> Iterator[None]:
        """Around a caller's reservation of tickets and the submission of the work that ends them.

        [Note: interrupted reservations]
        A ticket reserved is a promise that some work will end it, and everything reserved after it waits for that.
        An exception between the reservation and the submission (a KeyboardInterrupt the caller catches, or a
        fault) breaks the promise: the engine's next wait on that buffer would sit until `wait_timeout_s` (600 s)
        and then blame slowness. So any exception escaping a reservation fails the engine at once: the caller sees
        its own exception now, and its next engine call a clear error instead of a hang."""
        try:
            yield
        except BaseException as error:
            if self.error is None and not self.closed:
                self.fail(InterruptedReservationError(
                    f"{type(error).__name__} interrupted {what} while it was queueing work, so some of that work was "
                    f"never queued and what waits for it could never finish. The engine is closed: build a new one "
                    f"(resume from your last checkpoint)."), f"{what} (interrupted)")
            raise

    def wait(self, cond: threading.Condition, ready: Callable[[], bool], what: str, poll_s: float = POLL_S) -> None:
        """Wait on `cond` (held by the caller) until `ready()`, re-checking at least every `poll_s`; raise on
        failure or timeout."""
        start = time.monotonic()
        deadline = start + self.timeout_s
        while not ready():
            self.check()
            now = time.monotonic()
            if now > deadline:
                # The time really waited: a poll on a busy machine can overshoot the deadline by far.
                error = TimeoutError(f"waited {now - start:.1f} s for {what} (wait_timeout_s={self.timeout_s:g}); "
                                     f"raise wait_timeout_s (--roundpipe_wait_timeout_s, env ROUNDPIPE_WAIT_TIMEOUT_S) "
                                     f"if this work is legitimately slow.")
                self.fail(error, "a wait that timed out")  # stop the other threads too
                with self._lock:
                    self._reported = self._reported or not getattr(_engine_thread, "active", False)
                raise error
            cond.wait(poll_s)


class Future:
    """A value produced by one thread and read by others."""

    __slots__ = ("_cond", "_done", "_value", "what")

    def __init__(self, what: str = "") -> None:
        self._cond = threading.Condition()
        self._done = False
        self._value: Any = None
        self.what = what

    def set(self, value: Any) -> None:
        with self._cond:
            self._value = value
            self._done = True
            self._cond.notify_all()

    @property
    def done(self) -> bool:
        return self._done

    def get(self, failure: FailureFlag) -> Any:
        with self._cond:
            failure.wait(self._cond, lambda: self._done, self.what or "a result")
            return self._value

    def take(self, failure: FailureFlag) -> Any:
        """Get the value and drop the reference (it is read exactly once)."""
        value = self.get(failure)
        self._value = None
        return value


class ReadWriteOrder:
    """Ordered readers/writers of one buffer; see [Note: per-layer events]."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._writes_reserved = 0
        self._writes_done = 0
        self._open_reads: dict[int, int] = defaultdict(int)

    @property
    def version(self) -> int:
        """Writes completed so far."""
        return self._writes_done

    @property
    def reserved_writes(self) -> int:
        """Writes reserved so far: the version a read reserved now will see."""
        return self._writes_reserved

    def reserve_read(self) -> int:
        with self._cond:
            epoch = self._writes_reserved
            self._open_reads[epoch] += 1
            return epoch

    def reserve_write(self) -> int:
        with self._cond:
            ticket = self._writes_reserved
            self._writes_reserved += 1
            return ticket

    def begin_read(self, epoch: int, failure: FailureFlag, what: str) -> None:
        with self._cond:
            failure.wait(self._cond, lambda: self._writes_done >= epoch, what)
            assert self._writes_done == epoch, f"{what}: version {self._writes_done} != reserved {epoch}"

    def end_read(self, epoch: int) -> None:
        with self._cond:
            self._open_reads[epoch] -= 1
            if self._open_reads[epoch] == 0:
                del self._open_reads[epoch]
            self._cond.notify_all()

    def begin_write(self, ticket: int, failure: FailureFlag, what: str) -> None:
        with self._cond:
            failure.wait(self._cond, lambda: self._writes_done == ticket and not self._open_reads.get(ticket), what)

    def end_write(self, ticket: int) -> None:
        with self._cond:
            self._writes_done = ticket + 1
            self._cond.notify_all()


class Sequencer:
    """Strictly ordered operations on one buffer; see [Note: per-layer events]."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._reserved = 0
        self._done = 0
        # The waits over several sequencers watching this one (`wait_for_any_turn`), woken by every `end`.
        self._watchers: list[TurnWatch] = []

    def reserve(self) -> int:
        with self._cond:
            ticket = self._reserved
            self._reserved += 1
            return ticket

    def begin(self, ticket: int, failure: FailureFlag, what: str) -> None:
        with self._cond:
            failure.wait(self._cond, lambda: self._done == ticket, what)

    def end(self, ticket: int) -> None:
        with self._cond:
            self._done = ticket + 1
            self._cond.notify_all()
            for watch in self._watchers:
                watch.wake()

    def is_turn(self, ticket: int) -> bool:
        return self._done == ticket

    def watch(self, watch: TurnWatch) -> None:
        """Wake `watch` at every `end` from now on (until `unwatch`)."""
        with self._cond:
            self._watchers.append(watch)

    def unwatch(self, watch: TurnWatch) -> None:
        with self._cond:
            self._watchers.remove(watch)

    def wait_turn(self, ticket: int, seconds: float) -> bool:
        """Wait at most `seconds` for `ticket`'s turn; whether it came (for callers that watch several)."""
        with self._cond:
            if self._done != ticket:
                self._cond.wait(seconds)
            return self._done == ticket

    @property
    def idle(self) -> bool:
        return self._done == self._reserved


class TurnWatch:
    """One wait over several sequencers: each of them wakes it when any of its turns ends.

    It replaced a wait woken by the first sequencer only that re-checked the others every millisecond: the
    zero_grad job waits so through a whole pass, and woke a thousand times a second to take the interpreter's lock
    from the worker launching the pass (a sixth of a CPU worker's step on a 12-layer model)."""

    __slots__ = ("_cond", "_woken")

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._woken = False

    def wake(self) -> None:
        with self._cond:
            self._woken = True
            self._cond.notify_all()

    def wait(self, ready: Callable[[], list[int]], failure: FailureFlag, what: str) -> list[int]:
        """`ready()` once it is not empty: re-checked at each wake-up, raising on failure or timeout."""
        found: list[int] = []

        def turned() -> bool:
            if self._woken:  # re-checked only when woken: a timed-out poll has nothing new to see
                self._woken = False  # before the check: a turn ending after it wakes the next one
                found[:] = ready()
            return bool(found)

        with self._cond:
            failure.wait(self._cond, turned, what)
        return found


def wait_for_any_turn(turns: list[tuple[Sequencer, int]], failure: FailureFlag, what: str) -> list[int]:
    """Indices of the `(sequencer, ticket)` pairs whose turn has come, waiting until at least one has: woken by
    whichever sequencer ends a turn ([`TurnWatch`])."""
    def ready() -> list[int]:
        return [i for i, (sequencer, ticket) in enumerate(turns) if sequencer.is_turn(ticket)]

    watch = TurnWatch()
    sequencers = list({id(sequencer): sequencer for sequencer, _ in turns}.values())
    for sequencer in sequencers:
        sequencer.watch(watch)
    try:
        watch.wake()  # the first check: turns that came before the watch was registered
        return watch.wait(ready, failure, what)
    finally:
        for sequencer in sequencers:
            sequencer.unwatch(watch)


class SerialExecutor:
    """Runs host jobs (optimizer steps, write-backs, gradient commits) in FIFO order on one thread."""

    def __init__(self, failure: FailureFlag, name: str) -> None:
        self.failure = failure
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._cond = threading.Condition()
        self._pending = 0
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        with self._cond:
            self._pending += 1
        self._queue.put(job)

    def stop(self) -> None:
        self._queue.put(None)

    @property
    def idle(self) -> bool:
        """No job queued or running."""
        return self._pending == 0

    def wait_idle(self) -> None:
        with self._cond:
            self.failure.wait(self._cond, lambda: self._pending == 0, f"{self.thread.name} to finish")

    def _loop(self) -> None:
        mark_engine_thread()
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                if self.failure.running:
                    job()
            except BaseException as error:  # noqa: BLE001 - reported to the caller
                self.failure.fail(error, f"{self.thread.name} ({getattr(job, '__name__', 'job')})")
            finally:
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()
