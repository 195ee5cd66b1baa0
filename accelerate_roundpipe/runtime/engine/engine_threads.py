"""The engine's threads (device workers, host-ops, optimizer) and how they stop: at `close()`, at exit, or when the
engine is dropped without `close()`. Held apart from the engine so that a finalizer can stop them without keeping it
alive."""

from __future__ import annotations

import atexit
import logging
import threading
import time

from ..common.sync import FailureFlag
from ..distribution.gloo_exchange import DataParallelGroup
from ..distribution.gradient_exchange import NoExchange
from ..execution.deferred import DeferredPasses
from ..execution.dispatch import Dispatcher
from ..optimizer.optimizer import RoundPipeOptimizer
from ..state.host_store import HostStore

logger = logging.getLogger(__name__)
_exiting = False  # set at interpreter exit, before the finalizers of engines still alive run
_registered = False  # whether `_set_exiting` is registered


def note_exit_before_finalizers() -> None:
    """Register, once, what tells `abandon` that the process is exiting. Called after the engine's finalizer was
    made: `weakref.finalize` registered its exit hook by then, and exit hooks run last registered first."""
    global _registered
    if not _registered:
        _registered = True
        atexit.register(_set_exiting)


def _set_exiting() -> None:
    global _exiting
    _exiting = True


CLOSE_WARNING_S = 10.0  # close() warns this often while a thread still runs a layer or a step


class EngineThreads:
    """The engine's threads, held apart from it so that a finalizer can stop them without keeping it alive."""

    def __init__(self, dispatch: Dispatcher, deferred: DeferredPasses, failure: FailureFlag,
                 exchange: NoExchange | DataParallelGroup, store: HostStore) -> None:
        self.dispatch = dispatch  # the device workers, started on first use
        self.store = store  # whose buffers `release` lets go of ([Note: memory freed at close])
        self.deferred = deferred  # its host-ops thread resolves deferred commits ([Note: deferred gradient commit])
        self.failure = failure  # closed to cancel pending work when the engine is dropped without close()
        self.exchange = exchange  # [Note: gradient exchange]
        self.optimizer: RoundPipeOptimizer | None = None  # the wrapped optimizer, with its thread

    def use_optimizer(self, optimizer: RoundPipeOptimizer) -> None:
        """The optimizer `wrap_optimizer` built (the previous one closed): its thread is stopped with the others."""
        self.optimizer = optimizer

    def abandon(self) -> None:
        """The engine was dropped without `close()`: cancel what is still pending instead of finishing it (a step
        may wait for gradients of a pass nobody will commit), then stop the threads. Closing the failure flag makes
        every wait in those threads abort within a poll interval, so the joins below return promptly. Under data
        parallelism the queued steps are finished first and the ranks meet ([Note: end of a data-parallel run]):
        cancelled, they would leave the peers inside this rank's last collectives."""
        self.exchange.before_abandon()  # data-parallel: finish_collectives
        self.failure.close()
        self.stop()
        self.exchange.close(clean=False)  # its stream threads end; at exit they are waited for
        if not _exiting:  # at exit the process's memory goes with it, and unlocking it takes time
            self.release()

    def release(self) -> None:
        """Once every thread has ended: the workers, the optimizer and the store let go of their buffers
        ([Note: memory freed at close]). Not while one still runs (a layer longer than `stop`'s timeout, or this
        very thread, when a collection on it freed the engine): it may be using them, and the collector frees
        them later."""
        if any(t.is_alive() for t in self._threads()):
            return
        for worker in self.dispatch.workers or []:
            worker.release()
        if self.optimizer is not None:
            self.optimizer.release()
        self.store.release()

    def _threads(self) -> list[threading.Thread]:
        threads = [t for worker in self.dispatch.workers or [] for t in worker.threads]
        threads += [executor.thread for executor in
                    (self.optimizer.thread if self.optimizer is not None else None, self.deferred.host_ops)
                    if executor is not None]
        return [t for t in threads if t.ident is not None]

    def finish_collectives(self) -> None:
        """At exit or when dropped, healthy, data-parallel: drain the optimizer thread (its queued steps wait only
        for passes already on the workers) and meet the peers, as the end of `train()` does; unless the process is
        dying of an error (a peer should learn of it at once, not at the timeout) or the engine failed."""
        import sys

        if self.failure.error is not None or self.failure.closed or getattr(sys, "last_value", None) is not None:
            return
        if threading.current_thread().name.startswith("roundpipe-"):
            return  # freed by a collection on one of its own threads: that thread cannot wait for itself
        try:
            if self.optimizer is not None:
                self.optimizer.thread.wait_idle()
                self.failure.check()
            self.exchange.meet_peers(only_after_collectives=True)
        except Exception as error:  # noqa: BLE001 - at exit nobody can catch it; the peers see their own errors
            logger.warning("RoundPipe could not finish its data-parallel steps with the other ranks before exiting: "
                           "%s", error)

    def stop(self, join_timeout_s: float | None = 10.0) -> None:
        """Stop and join every thread (also at interpreter exit: a thread killed inside a torch op aborts). With
        `join_timeout_s=None` (`close()`) wait until each has ended, however long its current layer or step takes:
        `close()` then frees the host memory, which a thread still running would use; a warning every
        `CLOSE_WARNING_S` names the threads still running."""
        for worker in self.dispatch.workers or []:
            worker.stop()
        for executor in (self.optimizer.thread if self.optimizer is not None else None, self.deferred.host_ops):
            if executor is not None:
                executor.stop()
        threads = [t for t in self._threads() if t is not threading.current_thread()]
        if join_timeout_s is not None:
            for thread in threads:
                thread.join(join_timeout_s)
            return
        # The clock, not a sum of join timeouts: a join returns early when its thread ends, so the warnings would
        # report more than was waited ("10 s" after 1.7 s).
        start = time.monotonic()
        next_warning = start + CLOSE_WARNING_S
        while True:
            for thread in threads:
                thread.join(max(next_warning - time.monotonic(), 0.0))
            threads = [t for t in threads if t.is_alive()]
            if not threads:
                return
            if time.monotonic() >= next_warning:
                logger.warning("RoundPipe close() has waited %.1f s for %s to finish the layer or step it is running "
                               "(its work is cancelled; it stops at its next wait).", time.monotonic() - start,
                               ", ".join(t.name for t in threads))
                next_warning = time.monotonic() + CLOSE_WARNING_S
