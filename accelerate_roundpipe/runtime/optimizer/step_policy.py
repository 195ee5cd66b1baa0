"""The two ways one optimizer step is scheduled on the optimizer thread: exact (the default) and lagged by one
iteration (`async_optimizer`). Both step each bucket the same way (the optimizer's step of a bucket, which it hands
them in a `StepSite`); they differ in the tickets they reserve and in when the stepped weights reach the compute
copies ([Note: one-step lag]).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..common.sync import FailureFlag, wait_for_any_turn
from ..state.host_store import Bucket
from ..stepping.clip import GradientClip

Hyper = list[dict[str, Any]]


@dataclass(frozen=True)
class StepSite:
    """What a step policy drives, handed to it by the optimizer at each `step()`: the optimizer's buckets, its
    thread, and how it steps and writes back a bucket. A policy knows the optimizer through this alone."""

    step_order: list[Bucket]  # the trainable buckets in backward order
    failure: FailureFlag
    fixed_order: bool  # the layout's: an exact step takes the buckets in the same order on every rank
    submit: Callable[[Callable[[], None]], None]  # a job queued on the optimizer thread
    # bucket, gradient turn, write turn: stepped in the write turns, where the next uploads read them
    step_exactly: Callable[[list[tuple[Bucket, int, int]], Hyper, GradientClip | None], None]
    step: Callable[[list[tuple[Bucket, int]], Hyper, GradientClip | None], None]  # bucket, gradient turn
    stepped_without_write_back: Callable[[list[Bucket]], None]  # an exact step's compute copies not written yet
    write_back_stale: Callable[[], None]  # queue the write-backs of those
    hold_writeback: Callable[[Bucket], None]  # a lagged step's write-back, released at the next `step()`


def announce_steps(buckets: list[Bucket], clip: GradientClip | None) -> None:
    """Tell each tier its buckets among `buckets` (in backward order) in the order the coming step takes them:
    backward order, bottom-up after a clip ([Note: exact step order]); a disk tier's prefetch order
    ([Note: state tiers])."""
    by_tier: dict[int, tuple[Any, list[Bucket]]] = {}
    for bucket in (buckets if clip is None else reversed(buckets)):
        by_tier.setdefault(id(bucket.tier), (bucket.tier, []))[1].append(bucket)
    for tier, its in by_tier.values():
        tier.will_step(its)


class ExactStep:
    """Iteration k+1 reads the weights after step k: each bucket steps in its write turn, straight into the
    optimizer copy the next uploads read ([Note: exact step without write-back])."""

    @staticmethod
    def reserve(bucket: Bucket) -> tuple[Bucket, int, int]:
        """An exact step's turns of `bucket` (its gradients, its write), and the new version its readers will get."""
        bucket.versions.reserve_new_version()
        return bucket, bucket.grads.reserve(), bucket.reads.reserve_write()

    def schedule(self, site: StepSite, hyper: Hyper, clip: GradientClip | None) -> None:
        announce_steps(site.step_order, clip)
        entries = [self.reserve(bucket) for bucket in site.step_order]
        site.submit(self.job(site, entries, hyper, clip))
        site.stepped_without_write_back(site.step_order)

    @staticmethod
    def job(site: StepSite, entries: list[tuple[Bucket, int, int]], hyper: Hyper,
             clip: GradientClip | None) -> Callable[[], None]:
        """[Note: exact step order]
        One job steps and writes back every bucket of an exact step (`entries`: bucket, gradient turn, write turn,
        in backward order), always taking, among the buckets whose gradients are final, the lowest one: the next
        iteration's forward needs the bottom layers first. While the backward runs that is simply each bucket as it
        lands (top layers first); what is still waiting when the backward ends (the bottom layers, which land last;
        every layer when a clip needs the global norm first) then goes bottom-up, so the next forward starts as
        soon as its first layers are written ([Note: uploads as versions land]) instead of after the whole step.
        Each bucket's step is written where the next upload reads it ([Note: exact step without write-back]).
        Each bucket's step is independent of the others', so the order changes no result. Under data parallelism
        the order is fixed instead, the same on every rank ([Note: data parallel]): backward order, or bottom-up
        after a clip (whose jobs reduced every bucket first)."""
        failure = site.failure

        def step_in_fixed_order() -> None:
            for bucket, grad_ticket, write_ticket in (entries if clip is None else reversed(entries)):
                failure.check()
                site.step_exactly([(bucket, grad_ticket, write_ticket)], hyper, clip)

        if site.fixed_order:
            return step_in_fixed_order

        def step_as_gradients_land() -> None:
            pending = list(entries)
            while pending:
                failure.check()  # one job for every bucket: stop at a failure as the job queue would
                eligible = _in_announced_order(pending, clip is not None)  # indices into pending
                ready = wait_for_any_turn([(pending[i][0].grads, pending[i][1]) for i in eligible], failure,
                                          f"gradients of {pending[0][0]} (or a bucket below) for the optimizer step")
                ready = [eligible[i] for i in ready]
                entry = min((pending[i] for i in ready), key=lambda e: min(e[0].layers))
                # a device bucket goes with the other device buckets ready: [Note: device steps in one call]
                group = entry[0].tier.step_group
                batch = [entry] if group is None else [pending[i] for i in ready
                                                       if pending[i][0].tier.step_group == group]
                for each in batch:
                    pending.remove(each)
                site.step_exactly(batch, hyper, clip)

        return step_as_gradients_land


def _in_announced_order(pending: list[tuple[Bucket, int, int]], bottom_up: bool) -> list[int]:
    """The indices (in order) of the entries of `pending` (backward order) the exact step may take next: every
    bucket, except that of a tier with `ordered_steps` (the disk's staging reads in one order: [Note: state tiers])
    only its next bucket in the order `announce_steps` gave it, backward order or bottom-up after a clip."""
    first: dict[int, int] = {}  # id(tier) -> the index of its next bucket
    for i in (reversed(range(len(pending))) if bottom_up else range(len(pending))):
        tier = pending[i][0].tier
        if tier.ordered_steps:
            first.setdefault(id(tier), i)
    return [i for i, (bucket, _, _) in enumerate(pending)
            if not bucket.tier.ordered_steps or first[id(bucket.tier)] == i]


class LaggedStep:
    """Iteration k+1 computes with the weights after step k-1 while step k runs beside it: each bucket steps as its
    gradients are final, and its write-back waits until the next iteration reserved its reads.

    [Note: device steps are exact]
    A bucket whose optimizer state lives on a device ([Note: optimizer placement]) steps exactly even here: the lag
    exists to hide the host's step behind the next iteration, and a device step (well under a millisecond a layer)
    has nothing to hide. So with `async_optimizer` the buckets on the host lag by one step and those on a device do
    not; with every bucket on a device the lagged step is the exact one."""

    def schedule(self, site: StepSite, hyper: Hyper, clip: GradientClip | None) -> None:
        # A lagged step writes the optimizer copies outside the read tickets: first move the version readers are
        # entitled to back into the compute copies ([Note: exact step without write-back]).
        site.write_back_stale()
        # [Note: device steps are exact]: the device buckets first, as an exact step of their own (together and
        # bottom-up), so the next forward never waits behind the host's lagged steps, which the lag hides anyway.
        exact = [bucket for bucket in site.step_order if bucket.tier.steps_exactly_when_lagged]
        announce_steps(exact, clip)
        announce_steps([bucket for bucket in site.step_order if not bucket.tier.steps_exactly_when_lagged], None)
        on_device = [ExactStep.reserve(bucket) for bucket in exact]
        if on_device:
            site.submit(ExactStep.job(site, on_device, hyper, clip))
        for bucket in site.step_order:  # backward order: each job waits only for its own bucket's gradients
            if not bucket.tier.steps_exactly_when_lagged:
                turn = (bucket, bucket.grads.reserve())
                site.submit(lambda turn=turn: site.step([turn], hyper, clip))
                site.hold_writeback(bucket)
