"""The engine's threads (device workers, host-ops, optimizer) and how they stop: at `close()`, at exit, or when the
engine is dropped without `close()`. Held apart from the engine so that a finalizer can stop them without keeping it
alive."""

from __future__ import annotations

import logging
import threading
import time

from ..common.sync import FailureFlag
from ..distribution.gloo_exchange import DataParallelGroup
from ..distribution.gradient_exchange import NoExchange
from ..execution.deferred import DeferredPasses
from ..execution.dispatch import Dispatcher
from ..optimizer.optimizer import RoundPipeOptimizer

logger = logging.getLogger(__name__)
CLOSE_WARNING_S = 10.0  # close() warns this often while a thread still runs a layer or a step


class EngineThreads:
    """The engine's threads, held apart from it so that a finalizer can stop them without keeping it alive."""

    def __init__(self, dispatch: Dispatcher, deferred: DeferredPasses, failure: FailureFlag,
                 exchange: NoExchange | DataParallelGroup) -> None:
        self.dispatch = dispatch  # the device workers, started on first use
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
        threads = []
        for worker in self.dispatch.workers or []:
            worker.stop()
            threads.extend(worker.threads)
        for executor in (self.optimizer.thread if self.optimizer is not None else None, self.deferred.host_ops):
            if executor is not None:
                executor.stop()
                threads.append(executor.thread)
        threads = [t for t in threads if t is not threading.current_thread() and t.ident is not None]
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
