"""The gradient exchange over gloo: data parallelism across processes, one RoundPipe engine per process (machine),
the processes one group ([Note: gradient exchange]: one process has `NoExchange` instead).

[Note: data parallel]
Each process runs its own engine over its local devices on its share of the global batch; the processes form a
data-parallel group over `torch.distributed` (`DataParallelGroup`, `engine.data_parallel`, None on one process).
What every rank computes is what ONE process would compute on the whole global batch:
- The loss. A "mean" loss weights each micro-batch by its label count over the label count of the GLOBAL batch
  (one all-reduce of the counts per pass, [Note: micro-batch loss weights]); the weighted micro-batch losses of
  all ranks are all-reduced, so `forward_backward` returns the global batch's loss, the same value on every rank.
  The gradient each rank produces is then its share of the global loss's gradient, and the step uses the SUM of
  the ranks' gradients, never an average: uneven label counts per rank stay exact. The deferred path is exact too:
  the loss's backward brings the same c on every rank and each rank commits c times its share. A "sum" loss
  (`loss_reduction="sum"`, the Hugging Face models' `sum / num_items_in_batch`) adds the ranks' sums, so its
  normaliser must count the global batch (the models all-reduce their own count when none is given).
- The step. Every trainable bucket's flat buffers are padded to a multiple of `world_size * 16` elements and
  split into `world_size` equal contiguous ranges; rank r owns range r (`ShardedSteps` in `shards.py`). Once a
  bucket's gradient for the step is final (the step's, or the clip's, gradient turn), the optimizer thread
  reduce-scatters it: each rank receives the global gradient of its range. Each rank steps its range only, with an
  optimizer of the user's class and hyper-parameters over views of its range (exact for element-wise optimizers:
  `ELEMENTWISE_OPTIMIZERS`; others are refused), so the optimizer state (Adam's moments) and the CPU step time per
  rank drop by the world size. The updated range is all-gathered into every rank's optimizer copy: the weights are
  full and identical on every rank. With the exact step the gather runs in the bucket's write turn, so the next
  iteration's uploads read the gathered version ([Note: exact step without write-back]); with the lagged step it
  runs in the step job and the held write-back moves it into the compute copy as on one process
  ([Note: one-step lag]). The staleness is exactly that of one process.
- Order. gloo matches collectives by issue order per group, so two threads never share a group: the caller's
  collectives (construction checks, the per-pass exchanges) run on `caller_group`, the optimizer thread's
  (reduce-scatter, all-gather, the clip's norm) on `optimizer_group`. The optimizer thread runs its jobs in the
  order the caller queued them (program order, the same on every rank), and within the exact step's job under DP
  the buckets go in a FIXED order instead of "the lowest final bucket first" ([Note: exact step order], which
  depends on thread timing): backward order without a clip; with a clip the clip's jobs reduce every bucket first
  (backward order), then the step goes bottom-up. Whether a bucket must be reduced again at the step (gradients
  added after the clip measured them) is decided from the gradient tickets, which are program order too.
- Clipping. The norm is that of the reduced (global) gradient: each rank sums the squares of its reduced ranges,
  then one scalar all-reduce ([Note: clipping without a drain]); the `PendingGradNorm` is the same on every rank.
- Failures. The groups are made with `wait_timeout_s` as their timeout: a collective waiting on a rank that died
  or stalled raises within it, naming the collective and that a peer may have failed (`DataParallelError`), and
  fails the engine through its `FailureFlag`. A rank whose pass failed (or whose engine failed since) still joins
  the pass's exchange with a failure flag set: every rank then learns which rank failed and why, at once. The
  optimizer thread's collectives run on the stream threads while it waits in slices, so that once the engine has
  failed it abandons a collective its failed peer will never join (gloo's asynchronous reduce-scatter cannot be
  polled: it runs inside `wait()`) and `close()` returns at once instead of after gloo's timeout.
- Streams. One gloo collective moves one TCP stream's worth: on the H200 machine (16 cores, two ranks on one
  host) a 192 MiB float32 reduce-scatter ran at 1.5 GB/s and an all-gather at 0.8 GB/s, and a Qwen3-1.7B step
  spent 11.9 of its 12.9 s in them. Cut into 8 chunks issued at once on 8 groups (one thread each) the same
  collectives ran at 3.8 and 5.6 GB/s (`benchmarks/gloo_bandwidth.py`). So the optimizer thread's reduce-scatters
  and all-gathers of large buckets are cut into `COLLECTIVE_STREAMS` chunks over as many groups; every rank cuts
  them the same way, each chunk is one collective on its own group in the same order everywhere, and the sum of
  each element is still taken once over the ranks, so nothing changes in the maths.
- Construction. The settings every rank must share (device count, micro-batches, async, dtypes, the buckets'
  sizes and dtypes) are compared with `all_gather_object` and refused with each rank's value; then rank 0's weights
  are broadcast, so every rank starts from the same weights (as DDP does).
`engine.parameters()`' `.grad` is this rank's share of the gradient (its sum over ranks is the global gradient),
never clipped (the clip scales the reduced ranges). `model(...)` followed by a loss's `backward()` (no labels, the
loss computed by the caller) commits whatever that loss's gradient is, and the step sums it over the ranks: that
loss must be the rank's share of the global loss (e.g. its local mean times its share of the global count).
"""

from __future__ import annotations

import atexit
import datetime
import logging
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..common.sync import POLL_S, FailureFlag
from ..state.host_store import ALIGN, HostStore
from .collective_streams import CollectiveStreams, join_at_exit
from .collectives import DataParallelError
from .rank_settings import differences
from .shards import ShardedSteps

EXCHANGE_WIDTH = 3  # values a per-pass exchange carries at most (the label totals of `loss_count_totals`)

logger = logging.getLogger(__name__)
COLLECTIVE_STREAMS = 8  # gloo groups the optimizer thread's large collectives are cut over ([Note: data parallel])
MIN_STREAM_ELEMENTS = 1 << 20  # per rank and chunk: below it a bucket goes as one collective


_LIVE_GROUPS: weakref.WeakSet[DataParallelGroup] = weakref.WeakSet()
# The streams of failed or dropped engines, with their timeout; joined at exit.
_STOPPED_STREAMS: dict[CollectiveStreams, float] = {}


def _end_groups_at_exit() -> None:
    """[Note: clean exit under data parallelism]
    A Python thread that is still running when the interpreter finalizes kills the process if it takes the GIL
    back from torch's C++ code: a daemon thread does so at finalization by `pthread_exit`, whose forced unwinding
    through the C++ frames ends in `std::terminate` ("terminate called without an active exception", SIGABRT)
    instead of the exit code of the error the rank raised. A collective stream thread does exactly that when the
    collective it is in returns (its peer exited: "connection closed"), and even when it merely drops its last job's
    tensors (their deallocation releases the GIL). That is the usual state of a rank whose peer failed: its
    optimizer thread abandoned the collective the failed peer never joins ([Note: data parallel], Failures), and
    `close()` does not wait for it (it returns at once). So at exit (atexit runs before daemon threads are stopped)
    each group first lets its engine finish its steps with the peers if it is healthy
    ([Note: end of a data-parallel run]), then stops its stream threads and joins them, at most gloo's timeout: a
    dead or exiting peer ends a stuck collective at once, a stalled one by the timeout. The ranks never wait on
    each other here: of two ranks, only the one that issued more collectives can be inside one the other never
    joins (they issue them in the same order on each group), and the other exits, which ends it."""
    for group in list(_LIVE_GROUPS):
        group.end_at_exit()
    for streams, timeout_s in list(_STOPPED_STREAMS.items()):
        join_at_exit(streams, timeout_s)


atexit.register(_end_groups_at_exit)


def chunk_bounds(per_rank: int, streams: int = COLLECTIVE_STREAMS,
                 min_elements: int | None = None) -> list[tuple[int, int]]:
    """The chunks (start, stop within a rank's range of `per_rank` elements) one collective is cut into: as many as
    `streams`, none smaller than `min_elements` (default `MIN_STREAM_ELEMENTS`; one chunk for small buckets)."""
    min_elements = MIN_STREAM_ELEMENTS if min_elements is None else min_elements
    count = max(1, min(streams, per_rank // max(1, min_elements)))
    edges = [per_rank * k // count for k in range(count + 1)]
    return list(zip(edges[:-1], edges[1:]))


class DataParallelGroup:
    """This process's place in the data-parallel group, and every collective the engine issues; see
    [Note: data parallel]."""

    def __init__(self, timeout_s: float) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.timeout_s = timeout_s
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        timeout = datetime.timedelta(seconds=timeout_s)
        # Two groups: gloo matches collectives by issue order, and the caller and the optimizer thread issue theirs
        # independently. Host tensors throughout (the host store), hence gloo whatever the default backend is.
        self.caller_group = dist.new_group(backend="gloo", timeout=timeout)
        self.optimizer_group = dist.new_group(backend="gloo", timeout=timeout)
        # The optimizer thread's large collectives go in chunks over these groups at once ([Note: data parallel]).
        self.stream_groups = [self.optimizer_group] + [dist.new_group(backend="gloo", timeout=timeout)
                                                       for _ in range(COLLECTIVE_STREAMS - 1)]
        self._streams = CollectiveStreams(COLLECTIVE_STREAMS)
        # The engine's "finish the steps with the peers" (drain, barrier), run at exit before the streams end.
        self.before_exit: Callable[[], None] | None = None
        _LIVE_GROUPS.add(self)
        # Optimizer-thread collectives since the last `barrier()`: whether an end of the run must meet the peers
        # first ([Note: end of a data-parallel run]). The same on every rank at the same point of the program.
        self.collectives_since_barrier = 0
        # The engine's: the optimizer thread abandons its collective when the engine fails (its peers may never
        # join it), so that close() does not wait for gloo's timeout. Set by the engine.
        self.failure: FailureFlag | None = None

    def __repr__(self) -> str:
        return f"DataParallelGroup(rank={self.rank}, world_size={self.world_size})"

    @property
    def pad_multiple(self) -> int:
        """Trainable buckets are padded to a multiple of this, so every rank's range is equal and aligned."""
        return self.world_size * ALIGN

    def shard_range(self, numel: int) -> tuple[int, int]:
        """This rank's range of a padded flat buffer of `numel` elements."""
        chunk = numel // self.world_size
        return self.rank * chunk, (self.rank + 1) * chunk

    # ------------------------------------------------------------------ errors

    def _run(self, what: str, collective: Callable[[], Any]) -> Any:
        started = time.monotonic()
        try:
            return collective()
        except Exception as error:  # noqa: BLE001 - gloo raises RuntimeError / DistBackendError subclasses
            raise self._error(what, started, error) from error

    def _error(self, what: str, started: float, error: BaseException) -> DataParallelError:
        return DataParallelError(
            f"{what} across the {self.world_size} data-parallel processes failed on rank {self.rank} after "
            f"{time.monotonic() - started:.1f} s: {type(error).__name__}: {error}. A peer rank has probably "
            f"failed, been killed or stalled for longer than the timeout ({self.timeout_s:g} s, wait_timeout_s / "
            f"ROUNDPIPE_WAIT_TIMEOUT_S): look at the other ranks' errors.")

    def _run_on_streams(self, what: str, chunks: list[Callable[[], Any]]) -> None:
        """An optimizer-thread collective: `chunks[k]` on stream k (one daemon thread per group), while the
        optimizer thread waits in slices, so that a failure of this engine elsewhere abandons the wait
        (`FailureFlag.check` raises `Aborted` in engine threads) and `close()` need not wait for gloo's timeout:
        the peers of a failed rank may never join it. (gloo's asynchronous reduce-scatter cannot be polled: its
        work runs inside `wait()`.)"""
        started = time.monotonic()
        self.collectives_since_barrier += 1
        handle = self._streams.start(chunks)
        while not handle.finished.wait(POLL_S):
            if time.monotonic() - started > self.timeout_s + 10 * POLL_S:  # gloo's own timeout did not fire
                raise self._error(what, started, TimeoutError(f"no result after {self.timeout_s:g} s"))
            if self.failure is not None:
                self.failure.check()
        if handle.error is not None:
            raise self._error(what, started, handle.error) from handle.error

    def close(self, clean: bool = True) -> None:
        """Stop the helper threads once their collective (if any) ends; the engine is closing. After a `clean`
        close (every collective of this engine done on every rank: it synchronized first) the engine's process
        groups are destroyed, so a process that builds engine after engine does not pile up gloo groups and their
        connections; after a failure they are left to the process (a collective may still be stuck in one), and the
        stream threads are joined at exit at the latest ([Note: clean exit under data parallelism])."""
        self._streams.stop()
        _LIVE_GROUPS.discard(self)
        # A stream still inside a collective after the wait: destroying its group under it could abort the process.
        if clean and not self._streams.join(self.timeout_s):
            clean = False
        if not clean:
            for streams in [s for s in _STOPPED_STREAMS if s.join(0.0)]:
                del _STOPPED_STREAMS[streams]  # ended since
            _STOPPED_STREAMS[self._streams] = self.timeout_s
            return
        for group in dict.fromkeys([self.caller_group, *self.stream_groups]):
            self.dist.destroy_process_group(group)

    def end_at_exit(self) -> None:
        """At interpreter exit: the engine's steps finished with the peers (if it is healthy), then the stream
        threads stopped and joined ([Note: clean exit under data parallelism])."""
        if self.before_exit is not None:
            try:
                self.before_exit()
            except Exception as error:  # noqa: BLE001 - at exit nobody can catch it
                logger.warning("RoundPipe could not finish its data-parallel steps before exiting: %s", error)
        self._streams.stop()
        join_at_exit(self._streams, self.timeout_s)

    # ------------------------------------------------------------------ the caller's collectives

    def barrier(self) -> None:
        """[Note: end of a data-parallel run]
        Wait until every rank got here. Called at the end of a run (the Trainer's `train()`, `close()`, the engine's
        finalizer at exit) once this rank's optimizer thread drained: every rank then has every collective of its
        steps done. Without it, a rank whose own last all-gather was complete left (HF scripts' non-writing ranks
        return from `save_model` at once and exit; the engine's finalizer cancelled the steps still queued) while
        its peer still exchanged its last step, which then failed ("Connection closed by peer") and saved nothing.
        On `caller_group`: nothing else runs on it then (the caller is here)."""
        self._run("the end-of-run barrier (every rank's optimizer steps done)",
                  lambda: self.dist.barrier(group=self.caller_group))
        self.collectives_since_barrier = 0

    def check_same(self, what: str, settings: dict[str, Any]) -> None:
        """Refuse (on every rank) settings that differ between ranks."""
        per_rank: list[Any] = [None] * self.world_size
        self._run(f"the comparison of {what}",
                  lambda: self.dist.all_gather_object(per_rank, settings, group=self.caller_group))
        lines = differences(per_rank)
        if lines:
            raise DataParallelError(
                f"the data-parallel ranks disagree on {what}; every rank must use the same values:\n  "
                + "\n  ".join(lines) + "\nMake the configuration (and the model) the same on every process.")

    def broadcast_weights(self, store: HostStore) -> None:
        """Every rank starts from rank 0's weights (compute and optimizer copies)."""
        for bucket in store.buckets:
            for flat in (bucket.compute, bucket.optim):
                if flat is not None:
                    self._run(f"the broadcast of {bucket}'s initial weights from rank 0",
                              lambda flat=flat: self.dist.broadcast(flat, src=self._global(0), group=self.caller_group))

    def _global(self, group_rank: int) -> int:
        return self.dist.get_global_rank(self.caller_group, group_rank)

    def exchange(self, values: list[float], what: str) -> list[float]:
        """Sum `values` (at most `EXCHANGE_WIDTH`) over the ranks: the caller's per-pass exchanges. A rank that failed
        joins it through `tell_failure` instead: every other rank then raises a `DataParallelError` naming it and
        its error. Every exchange has the same size, whatever the caller sums, so that a failure report always
        meets it (a collective of another size aborts the process)."""
        if len(values) > EXCHANGE_WIDTH:
            raise ValueError(f"a per-pass exchange sums at most {EXCHANGE_WIDTH} values; got {len(values)}.")
        packed = torch.zeros(EXCHANGE_WIDTH + self.world_size, dtype=torch.float64)
        packed[:len(values)] = torch.tensor(values, dtype=torch.float64)
        self._run(what, lambda: self.dist.all_reduce(packed, group=self.caller_group))
        failed = [r for r in range(self.world_size) if packed[EXCHANGE_WIDTH + r] > 0]
        if not failed:
            return packed[:len(values)].tolist()
        messages = self._gather_errors("")
        raise DataParallelError(
            f"data-parallel rank(s) {failed} of {self.world_size} failed (this is rank {self.rank}, stopped with "
            f"them at {what}): " + "; ".join(f"rank {r}: {messages[r]}" for r in failed)
            + ". The whole group stops: fix the failing rank and resume every rank from the last checkpoint.")

    def tell_failure(self, error: BaseException, where: str) -> None:
        """Join the exchange the other ranks wait in with this rank's failure (`error`, raised at `where`) flagged;
        quietly gives up when that collective fails too (a peer is gone already)."""
        packed = torch.zeros(EXCHANGE_WIDTH + self.world_size, dtype=torch.float64)
        packed[EXCHANGE_WIDTH + self.rank] = 1.0
        try:
            self._run(f"the report of rank {self.rank}'s failure", lambda: self.dist.all_reduce(
                packed, group=self.caller_group))
            self._gather_errors(f"{type(error).__name__}: {error} (at {where})")
        except DataParallelError:
            pass

    def _gather_errors(self, text: str) -> list[str]:
        messages: list[Any] = [None] * self.world_size
        self._run("the exchange of the failed ranks' errors",
                  lambda: self.dist.all_gather_object(messages, text, group=self.caller_group))
        return messages

    # ------------------------------------------------------------------ the optimizer thread's collectives

    def reduce_scatter(self, out: torch.Tensor, flat: torch.Tensor, what: str) -> None:
        """`out` = this rank's range of the sum over ranks of `flat`, in chunks over the stream groups."""
        per_rank = flat.numel() // self.world_size
        chunks = []
        for (start, stop), group in zip(chunk_bounds(per_rank), self.stream_groups):
            pieces = [flat[r * per_rank + start:r * per_rank + stop] for r in range(self.world_size)]
            chunks.append(lambda pieces=pieces, target=out[start:stop], group=group:
                          self.dist.reduce_scatter(target, pieces, group=group))
        self._run_on_streams(f"the reduce-scatter of {what}", chunks)

    def all_gather(self, flat: torch.Tensor, what: str) -> None:
        """Fill `flat` with every rank's range (this rank's own range is read in place: gloo gathers into a buffer
        of its own before writing the outputs), in chunks over the stream groups."""
        per_rank = flat.numel() // self.world_size
        chunks = []
        for (start, stop), group in zip(chunk_bounds(per_rank), self.stream_groups):
            pieces = [flat[r * per_rank + start:r * per_rank + stop] for r in range(self.world_size)]
            chunks.append(lambda pieces=pieces, group=group:
                          self.dist.all_gather(pieces, pieces[self.rank], group=group))
        self._run_on_streams(f"the all-gather of {what}", chunks)

    def sum_on_optimizer_thread(self, value: float, what: str) -> float:
        tensor = torch.tensor([value], dtype=torch.float64)
        self.sum_tensor_on_optimizer_thread(tensor, what)
        return float(tensor[0])

    def sum_tensor_on_optimizer_thread(self, tensor: torch.Tensor, what: str) -> None:
        """`tensor` summed over the ranks, in place."""
        # On stream 0, whose group is `optimizer_group`: in order with the chunks queued there before it.
        self._run_on_streams(what, [lambda: self.dist.all_reduce(tensor, group=self.optimizer_group)])

    # ---------------------------------------------- the engine's exchange ([Note: gradient exchange])

    @property
    def group(self) -> DataParallelGroup:
        return self

    def bind(self, failure: FailureFlag, finish_with_peers: Callable[[], None]) -> None:
        """The engine's failure flag (its failure abandons the optimizer thread's collectives) and its "finish the
        steps with the peers", run at exit ([Note: clean exit under data parallelism]) or when it is dropped."""
        self.failure = failure
        self.before_exit = finish_with_peers

    def optimizer_layout(self, user: torch.optim.Optimizer, store: HostStore, trace=None):
        """This rank's shard of the step of `user` ([Note: data parallel])."""
        return ShardedSteps(user, store, self, trace)

    def sum_over_ranks(self, values: list[float], what: str) -> list[float]:
        return self.exchange(values, what)

    def global_loss(self, loss: torch.Tensor, what: str) -> torch.Tensor:
        """The loss of the global batch: every rank's share of it, added."""
        total = self.exchange([float(loss)], what)[0]
        return torch.tensor(total, dtype=torch.float64).to(loss.dtype)

    def pass_failed(self, error: BaseException, where: str, failure: FailureFlag) -> None:
        """This rank's pass failed while the other ranks wait for it in the pass's exchange: tell them (they raise
        naming this rank and its error), and fail this engine too, since theirs fail."""
        self.tell_failure(error, where)
        failure.fail_here(error, where)

    def before_abandon(self) -> None:
        """The engine is dropped: its queued steps are finished with the peers first; cancelled, they would leave
        the peers inside this rank's last collectives ([Note: end of a data-parallel run])."""
        if self.before_exit is not None:
            self.before_exit()

    def meet_peers(self, only_after_collectives: bool = False) -> None:
        """`barrier()`; with `only_after_collectives`, only when the optimizer thread issued collectives since the
        last one ([Note: end of a data-parallel run])."""
        if not only_after_collectives or self.collectives_since_barrier:
            self.barrier()
