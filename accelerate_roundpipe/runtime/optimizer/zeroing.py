"""`zero_grad()`'s host job: each bucket's gradients forgotten (or zeroed) as soon as that bucket is stepped.

[Note: zeroing as each bucket is stepped]
`zero_grad()` forgets or zeroes each bucket's gradients in a gradient turn it reserves after the step's, so the next
pass's commits (reserved later) find them empty. Those jobs ran on the optimizer thread, one per bucket, queued
behind the one job that steps every bucket of an exact step ([Note: exact step order]): every bucket's gradient
buffer was alive until the whole step was done. Now one job on a host thread beside the optimizer's (the deferred
passes' host-ops thread: `DeferredPasses.submit`) takes the buckets as their turns come, in any order, so a bucket
is cleared as soon as it is stepped and, with `set_to_none`, its buffer goes back to the pool for the next download
([Note: no spare gradient buffer]). The tickets are the same as before: each bucket's clearing is after its step and
before anything reserved later, so no number changes. That thread runs its jobs in the order their turns were
reserved (the caller reserves and submits together), so a job there waits only for turns of other threads or of
jobs before it: nothing can wait for itself.

Nothing waits for memory here (no back-pressure on the downloads): the gradient buffers alive are the buckets
downloaded and not yet stepped, the optimizer's backlog, plus the downloads in flight. With a clip every bucket is
stepped only after the global norm is known, and with accumulation across calls no bucket is stepped before the
last call: there every gradient is alive until the step, as before.
"""

from __future__ import annotations

from collections.abc import Callable

from ..common.sync import FailureFlag, wait_for_any_turn
from ..state.host_store import Bucket


def zeroing_job(turns: list[tuple[Bucket, int]], set_to_none: bool, failure: FailureFlag) -> Callable[[], None]:
    """One job clearing (`set_to_none`) or zeroing each bucket of `turns` (bucket, gradient turn) in its turn,
    whichever comes first."""

    def zero_as_stepped() -> None:
        pending = list(turns)
        while pending:
            failure.check()
            ready = wait_for_any_turn([(bucket.grads, ticket) for bucket, ticket in pending], failure,
                                      f"gradients of {pending[0][0]} (or another bucket) for zero_grad")
            for index in sorted(ready, reverse=True):
                bucket, ticket = pending.pop(index)
                bucket.grads.begin(ticket, failure, f"gradients of {bucket} for zero_grad")
                try:
                    if set_to_none:
                        bucket.clear()
                    else:
                        bucket.zero()
                finally:
                    bucket.grads.end(ticket)

    return zero_as_stepped
