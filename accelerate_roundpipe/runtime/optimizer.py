"""The lagged CPU optimizer: any torch optimizer stepped bucket by bucket on a background thread.

[Note: one-step lag]
`step()` returns at once. A background thread steps each bucket as soon as its gradients are final, on the
optimizer copies. With `async_optimizer=True` (top layers first, the order their gradients become final) the
write-back into the compute copy is held until the next iteration has reserved its reads, so iteration k computes
with the weights after steps 0..k-2 (staleness 1) while step k-1 runs beside it. With it off (the exact step),
iteration k waits, per bucket, for step k-1 and reads the optimizer copy itself (see [Note: exact step order] and
[Note: exact step without write-back]). Either way the per-bucket tickets of [Note: per-layer events] keep every
read and write in order; `synchronize()` writes what is held or stale into the compute copies, so `engine.module`
then shows the newest weights.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from ..telemetry.trace import maybe_span
from . import faults
from .data_parallel import DataParallelError, DataParallelGroup
from .deferred import DeferredPasses
from .host_store import Bucket, HostStore
from .shards import BucketShard, ShardedSteps, full_state_of_shards
from .step_norm import PendingGradNorm, StepNorm, kernel_grad_scale
from .sync import FailureFlag, SerialExecutor, wait_for_any_turn

_FUSED_CPU = (torch.optim.Adam, torch.optim.AdamW)


def prefer_fused(optimizer: torch.optim.Optimizer) -> None:
    """Use torch's fused CPU kernel for Adam/AdamW groups that did not choose an implementation."""
    if not isinstance(optimizer, _FUSED_CPU):
        return
    for group in optimizer.param_groups:
        if group.get("fused") is None and not group.get("foreach") and not group.get("differentiable") \
                and all(p.is_floating_point() for p in group["params"]):
            group["fused"] = True
            group["foreach"] = False


class LaggedOptimizer(torch.optim.Optimizer):
    """Wraps a torch optimizer built over `engine.parameters()`; see [Note: one-step lag].

    `param_groups`, `state`, `state_dict()`, `load_state_dict()` and `zero_grad()` behave as the wrapped optimizer's.
    Hyper-parameters (e.g. the learning rate an LR scheduler sets) are read when `step()` is called. With
    `data_parallel`, an optimizer of the same class steps this rank's shard, and `state` / `state_dict()` are that
    shard's ([Note: data parallel]).
    """

    def __init__(self, inner: torch.optim.Optimizer, store: HostStore, failure: FailureFlag,
                 async_step: bool, deferred_passes: DeferredPasses | None = None, trace=None,
                 exact_steps_first: int = 0, data_parallel: DataParallelGroup | None = None) -> None:
        # Not calling Optimizer.__init__: the groups and the state stay the wrapped optimizer's own objects.
        self.inner = inner
        self.defaults = inner.defaults
        self.param_groups = inner.param_groups
        self.state = inner.state
        self._optimizer_step_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._zero_grad_profile_name = "Optimizer.zero_grad#LaggedOptimizer.zero_grad"
        self.store = store
        self.failure = failure
        self.async_step = async_step
        self.exact_steps_first = exact_steps_first  # an async warm-up: the first steps are exact
        self.steps_taken = 0
        self._deferred_passes = deferred_passes  # passes never back-propagated are dropped before gradients are used
        self.trace = trace
        self._held_writebacks: list[Bucket] = []  # write-backs held until the next iteration reserved its reads
        self._stale_compute: dict[int, Bucket] = {}  # exact steps not yet written back
        self._clip: StepNorm | None = None  # the clip the next step() applies ([Note: clipping without a drain])
        self._check_params()
        prefer_fused(inner)  # the step snapshots its groups' settings (a shard's optimizer too)
        self.data_parallel = data_parallel
        # Under data parallelism this rank steps its shard with an optimizer of its own ([Note: data parallel]).
        self._shards = ShardedSteps(inner, store, data_parallel) if data_parallel is not None else None
        self._stepper = self._shards.optimizer if self._shards is not None else inner
        if self._stepper is not inner:
            prefer_fused(self._stepper)
        self.state = self._stepper.state
        self.thread = SerialExecutor(failure, "roundpipe-optimizer")
        self._step_order = store.trainable_in_backward_order

    def _check_params(self) -> None:
        known = {id(s.optim): s for b in self.store.trainable_buckets for s in b.slots}
        for group in self.inner.param_groups:
            for p in group["params"]:
                if id(p) not in known:
                    raise ValueError(
                        "the optimizer holds a tensor that is not one of this engine's optimizer copies; build it "
                        "from the engine's parameters: `engine.wrap_optimizer(torch.optim.AdamW(engine.parameters()))`"
                        " (the wrapped module's own parameters are the compute copies and are never stepped).")

    # ------------------------------------------------------------------ the lag protocol

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        if closure is not None:
            raise ValueError("RoundPipe's lagged optimizer takes no closure: the step runs in the background after "
                             "the pipeline; call engine.forward_backward(...) then optimizer.step().")
        self.failure.check()
        self._drop_pending_passes()
        self.release_writebacks()  # an earlier step's write-back reads the optimizer copy this step overwrites
        snapshot = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        member_groups = [(g["params"], snap) for g, snap in zip(self.param_groups, snapshot)]
        clip, self._clip = self._clip, None
        lagged = self.async_step and self.steps_taken >= self.exact_steps_first
        self.steps_taken += 1
        self.inner._opt_called = True  # [Note: scheduler step count]
        with self.failure.reserving("optimizer.step()"):  # [Note: interrupted reservations]
            if not lagged:
                entries = [(bucket, bucket.grads.reserve(), bucket.reads.reserve_write())
                           for bucket in self._step_order]
                for bucket in self._step_order:
                    bucket.new_versions_reserved += 1
                self.thread.submit(self._exact_step_job(entries, member_groups, clip))
                self._stale_compute.update((bucket.index, bucket) for bucket in self._step_order)
                return
            # A lagged step writes the optimizer copies outside the read tickets: first move the version readers
            # are entitled to back into the compute copies ([Note: exact step without write-back]).
            self.write_back_stale()
            for bucket in self._step_order:
                ticket = bucket.grads.reserve()
                self.thread.submit(self._lagged_step_job(bucket, ticket, member_groups, clip))
                self._held_writebacks.append(bucket)

    # [Note: scheduler step count]
    # A torch LR scheduler wraps its optimizer's `step` (an attribute of that instance) to set `_opt_called`, and its
    # own `step()` warns "lr_scheduler.step() before optimizer.step()" when that is unset. The wrapped optimizer's
    # step runs later, on the optimizer thread, so `step()` says on the caller's thread what torch's wrapper would
    # say there: the step is taken (scheduled, with the learning rates read now). The optimizer thread calls the
    # class's `step` (its hooks included), not the instance's, so it never writes to the user's optimizer, whatever
    # a scheduler wrapped around it.

    def clip_grad_norm_(self, max_norm: float) -> PendingGradNorm:
        """Clip the gradients of the next `step()` to a global L2 norm of `max_norm`, as
        `torch.nn.utils.clip_grad_norm_` would now; returns that norm as a tensor filled in when first read.
        Nothing waits for the backward here ([Note: clipping without a drain])."""
        self.failure.check()
        self._drop_pending_passes()
        if self._clip is not None:
            raise RuntimeError("clip_grad_norm_ was called twice before optimizer.step(); clip once per step.")
        total = None
        if self.data_parallel is not None:  # the norm of the reduced, global gradient ([Note: data parallel])
            def total(squares: float) -> float:
                return self.data_parallel.sum_on_optimizer_thread(squares, "the all-reduce of the gradient norm")
        dtype = self._step_order[0].optim.dtype if self._step_order else torch.float32
        step_norm = StepNorm(len(self._step_order), max_norm, total, dtype)
        with self.failure.reserving("clip_grad_norm_()"):  # [Note: interrupted reservations]
            for bucket in self._step_order:  # top layers first: the order their gradients become final
                ticket = bucket.grads.reserve()
                self.thread.submit(self._norm_job(bucket, ticket, step_norm))
        self._clip = step_norm
        return PendingGradNorm(step_norm, self.failure, dtype)

    def _norm_job(self, bucket: Bucket, ticket: int, step_norm: StepNorm) -> Callable[[], None]:
        def measure_bucket() -> None:
            bucket.grads.begin(ticket, self.failure, f"gradients of {bucket} for the gradient norm")
            try:
                shard = self._shard(bucket)
                if shard is not None and bucket.grad_valid:
                    self._reduce(bucket, shard, ticket)  # the norm is the reduced (global) gradient's
                with maybe_span(self.trace, "optimizer", f"norm layers {list(bucket.layers)}"):
                    step_norm.add(bucket.squared_norm() if shard is None or not bucket.grad_valid
                                  else shard.squared_norm())
            finally:
                bucket.grads.end(ticket)

        return measure_bucket

    def _step_bucket(self, bucket: Bucket, ticket: int, member_groups, clip: StepNorm | None) -> None:
        """Step `bucket`'s parameters in its gradient turn `ticket` (clipped by `clip`'s coefficient)."""
        bucket.grads.begin(ticket, self.failure, f"gradients of {bucket} for the optimizer step")
        try:
            self.failure.check()  # a turn ended by a failed commit is not a gradient to step with
            faults.point("optimizer.step")
            shard = self._shard(bucket)
            if shard is not None and bucket.grad_valid and shard.reduced_at != ticket - 1:
                self._reduce(bucket, shard, ticket)  # no clip reduced it, or gradients came after the clip's
            if shard is not None:
                groups = self._shards.groups_for(bucket, member_groups)
            else:
                ids = {id(s.optim) for s in bucket.slots}
                groups = [dict(snap, params=[p for p in params if id(p) in ids]) for params, snap in member_groups]
                groups = [g for g in groups if g["params"]]
            stepper = self._stepper
            in_kernel = None  # a clip the fused kernel applies as it reads the gradients
            if clip is not None and bucket.grad_valid:
                coefficient = clip.clip_coefficient(self.failure)
                # torch multiplies by the clamped coefficient (0 or NaN too: [Note: non-finite clip]); by 1 changes
                # nothing
                if coefficient != 1.0:
                    if groups and self._clips_in_kernel(bucket, groups) and kernel_grad_scale(coefficient):
                        in_kernel = coefficient
                    elif shard is not None:
                        shard.grad.mul_(coefficient)
                    else:
                        bucket.scale(coefficient)
            if groups and bucket.grad_valid:
                original = stepper.param_groups
                stepper.param_groups = groups
                if in_kernel is not None:
                    stepper.grad_scale = torch.tensor(kernel_grad_scale(in_kernel), dtype=torch.float32)
                try:
                    with maybe_span(self.trace, "optimizer", f"step layers {list(bucket.layers)}"):
                        type(stepper).step(stepper)  # the class's step: [Note: scheduler step count]
                finally:
                    stepper.param_groups = original
                    if in_kernel is not None:
                        del stepper.grad_scale
                        if shard is None:
                            bucket.record_scale(in_kernel)
            if shard is not None and bucket.grad_valid:
                with maybe_span(self.trace, "optimizer", f"all-gather layers {list(bucket.layers)}"):
                    self.data_parallel.all_gather(bucket.optim, f"the stepped weights of {bucket}")
            bucket.optim_version_seen = bucket.optim._version
            bucket.steps.optim += 1  # [Note: torn weights]
        finally:
            bucket.grads.end(ticket)

    def _shard(self, bucket: Bucket) -> BucketShard | None:
        return self._shards.shards[bucket.index] if self._shards is not None else None

    def _reduce(self, bucket: Bucket, shard: BucketShard, ticket: int) -> None:
        """This rank's range of the sum over ranks of `bucket`'s gradients, in its gradient turn `ticket`."""
        with maybe_span(self.trace, "optimizer", f"reduce-scatter layers {list(bucket.layers)}"):
            self.data_parallel.reduce_scatter(shard.grad, bucket.grad, f"the gradients of {bucket}")
        shard.reduced_at = ticket

    def _write_back(self, bucket: Bucket, ticket: int) -> None:
        """Write the optimizer copy into the compute copy, in write turn `ticket`."""
        bucket.reads.begin_write(ticket, self.failure, f"readers of {bucket} before its write-back")
        try:
            faults.point("optimizer.writeback")
            with maybe_span(self.trace, "optimizer", f"write-back layers {list(bucket.layers)}"):
                bucket.compute.copy_(bucket.optim)
            bucket.steps.compute = bucket.steps.optim
            bucket.current_in_optim = False
            bucket.stash = None  # the pass that read it has read it ([Note: looking changes nothing])
        finally:
            bucket.reads.end_write(ticket)

    def _lagged_step_job(self, bucket: Bucket, ticket: int, member_groups,
                         clip: StepNorm | None) -> Callable[[], None]:
        def step_bucket() -> None:
            self._step_bucket(bucket, ticket, member_groups, clip)

        return step_bucket

    def _exact_step(self, bucket: Bucket, grad_ticket: int, write_ticket: int, member_groups,
                    clip: StepNorm | None) -> None:
        """[Note: exact step without write-back]
        An exact step writes the version its readers wait for straight into the optimizer copy, in the bucket's
        write turn, and the next uploads read that copy, cast to the compute dtype on the device. There is no
        write-back pass on the host: on one H200 (Qwen3-1.7B) the host step was the slower side of the exact
        iteration (about 21 ms a layer against a 14 ms backward), and the write-back was a quarter of it; the
        device casts in microseconds what costs the host a pass over every weight. The uploads carry the optimizer
        dtype (twice the bytes from float32 to bfloat16), which the copy engine overlaps with the step. The compute
        copies (what `engine.module` shows) are written only when someone on the host looks (`synchronize()`,
        checkpoints, `state_dict()`) and before a lagged step, which writes the optimizer copies outside the read
        tickets: `write_back_stale`."""
        bucket.reads.begin_write(write_ticket, self.failure, f"readers of {bucket} before its exact step")
        try:
            self._step_bucket(bucket, grad_ticket, member_groups, clip)
            bucket.current_in_optim = True
        finally:
            bucket.reads.end_write(write_ticket)

    def _clips_in_kernel(self, bucket: Bucket, groups: list[dict]) -> bool:
        """[Note: clip in the kernel]
        Whether torch's fused Adam/AdamW applies the clip itself: its kernel divides each gradient by `grad_scale`
        as it reads it (the hook `GradScaler` uses) and leaves the divided gradient in `.grad`, as a clip would.
        A separate scaling pass over the gradients cost 4-5 ms a layer on the host of an exact, clipped step, whose
        whole host step sits between two iterations. The kernel reads the scale in float32, so this serves float32
        gradients only (the scale's rounding is then that of the gradients'); float64 keeps the exact pass."""
        return (isinstance(self._stepper, _FUSED_CPU) and bucket.grad.dtype == torch.float32
                and all(g.get("fused") for g in groups))

    def write_back_after_failure(self, timeout_s: float = 10.0) -> None:
        """After a failure: once the optimizer thread has no job left (they are skipped or aborted at once), write
        the exact steps' optimizer copies into the compute copies, so a failed engine's module shows the step its
        layers all reached ([Note: torn weights], [Note: exact step without write-back])."""
        from .torn import TornWeightsError

        deadline = time.monotonic() + timeout_s
        while not self.thread.idle:
            if time.monotonic() > deadline:
                raise TornWeightsError("the RoundPipe engine failed and its optimizer thread did not stop within "
                                       f"{timeout_s:g} s, so its newest weights cannot be written into the model.")
            time.sleep(0.01)
        with torch.no_grad():
            for bucket in self.store.trainable_buckets:
                if bucket.current_in_optim:
                    bucket.compute.copy_(bucket.optim)
                    bucket.steps.compute = bucket.steps.optim
                    bucket.current_in_optim = False

    def write_back_stale(self) -> None:
        """Queue the write-backs of the exact steps not written back yet ([Note: exact step without write-back])."""
        stale, self._stale_compute = self._stale_compute, {}
        for bucket in stale.values():
            self._submit_writeback(bucket, new_version=False)  # the version readers get already: no change

    def _exact_step_job(self, entries: list[tuple[Bucket, int, int]], member_groups,
                        clip: StepNorm | None) -> Callable[[], None]:
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
        def step_in_fixed_order() -> None:
            for bucket, grad_ticket, write_ticket in (entries if clip is None else reversed(entries)):
                self.failure.check()
                self._exact_step(bucket, grad_ticket, write_ticket, member_groups, clip)

        if self.data_parallel is not None:
            return step_in_fixed_order

        def step_as_gradients_land() -> None:
            pending = list(entries)
            while pending:
                self.failure.check()  # one job for every bucket: stop at a failure as the job queue would
                ready = wait_for_any_turn([(bucket.grads, ticket) for bucket, ticket, _ in pending], self.failure,
                                          f"gradients of {pending[0][0]} (or a bucket below) for the optimizer step")
                bucket, grad_ticket, write_ticket = min((pending[i] for i in ready), key=lambda e: min(e[0].layers))
                pending.remove((bucket, grad_ticket, write_ticket))
                self._exact_step(bucket, grad_ticket, write_ticket, member_groups, clip)

        return step_as_gradients_land

    def _submit_writeback(self, bucket: Bucket, new_version: bool) -> None:
        ticket = bucket.reads.reserve_write()
        bucket.new_versions_reserved += new_version
        self.thread.submit(lambda: self._write_back(bucket, ticket))

    def release_writebacks(self) -> None:
        """Reserve the held write-backs after the reads reserved so far (called by the engine)."""
        held, self._held_writebacks = self._held_writebacks, []
        with self.failure.reserving("a write-back"):  # [Note: interrupted reservations]
            for bucket in held:
                self._submit_writeback(bucket, new_version=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.failure.check()
        self._drop_pending_passes()
        self._clip = None  # a clip measured gradients that are gone now
        with self.failure.reserving("zero_grad()"):  # [Note: interrupted reservations]
            self._reserve_zeroing(set_to_none)

    def _reserve_zeroing(self, set_to_none: bool) -> None:
        for bucket in self._step_order:
            ticket = bucket.grads.reserve()

            def zero(bucket=bucket, ticket=ticket) -> None:
                bucket.grads.begin(ticket, self.failure, f"gradients of {bucket} for zero_grad")
                try:
                    if set_to_none:
                        bucket.clear()
                    else:
                        bucket.zero()
                finally:
                    bucket.grads.end(ticket)

            self.thread.submit(zero)

    def _drop_pending_passes(self) -> None:
        if self._deferred_passes is not None:
            self._deferred_passes.drop_pending()

    def show_newest(self) -> None:
        """[Note: looking changes nothing]
        Put the newest weights in the compute copies (what `engine.module`, a checkpoint or an evaluation pass
        reads) without changing what the next training pass reads. With the lagged step the next pass must compute
        with the weights one step old, which the compute copies hold until the held write-back; releasing that
        write-back early to show the newest weights (as looking did) made every run that evaluated or saved follow
        another trajectory than one that did not. So a look waits for the held steps, keeps the compute copy's
        older version aside (`bucket.stash`, which the next training pass's uploads read) and writes the newest
        weights into the compute copy; the held write-back, released by the next training pass as before, drops
        the stash. The caller makes sure nothing is reading the compute copies (no pass in flight). The stash costs
        one compute-sized host buffer per held bucket until the next training pass."""
        if not self.has_held_steps:
            return
        self.thread.wait_idle()  # the held buckets' lagged steps are done: their optimizer copies are the newest
        with torch.no_grad():
            for bucket in self._held_writebacks:
                if bucket.stash is None:  # else this step is shown already
                    bucket.stash = bucket.compute.clone()
                    bucket.compute.copy_(bucket.optim)
                    bucket.steps.compute = bucket.steps.optim

    @property
    def has_held_steps(self) -> bool:
        """Lagged steps whose newest weights the compute copies do not show yet."""
        return any(bucket.stash is None for bucket in self._held_writebacks)

    def hold_shown(self, buckets: list[Bucket]) -> None:
        """Hold the write-backs of `buckets`, whose stashes a checkpoint restored: the next training pass reads
        the stash, then the write-back drops it, as after a look ([Note: looking changes nothing])."""
        for bucket in buckets:
            if bucket not in self._held_writebacks:
                self._held_writebacks.append(bucket)

    def forget_stashes(self) -> None:
        """The compute copies were loaded from outside: the next pass reads them, not a stash."""
        for bucket in self._held_writebacks:
            bucket.stash = None

    def synchronize(self) -> None:
        """Wait for every step and show the newest weights in the compute copies; the engine waits for the passes
        in flight first."""
        self.write_back_stale()
        self.thread.wait_idle()
        self.show_newest()
        self.failure.check()

    def close(self) -> None:
        self.thread.stop()

    # ------------------------------------------------------------------ torch.optim.Optimizer API

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict; under data parallelism this rank's shard of it, with the world size,
        the rank and the shard layout ([Note: data parallel])."""
        self.synchronize()
        if self._shards is not None:
            return self._shards.state_dict()
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Under data parallelism: this rank's shard as `state_dict()` saved it (same world size), or a
        one-process state dict, which each rank cuts to its shard."""
        self.synchronize()
        if self._shards is not None:
            self._shards.load_state_dict(state_dict)
            self.state = self._stepper.state
            prefer_fused(self._stepper)
            return
        meta = state_dict.get("data_parallel")
        if meta is not None:
            raise DataParallelError(
                f"this optimizer state is rank {meta['rank']}'s shard of a run with {meta['world_size']} "
                f"data-parallel processes; this engine runs on one process. Resume with {meta['world_size']} "
                f"processes, each loading its own rank's file.")
        self.inner.load_state_dict(state_dict)
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
        prefer_fused(self.inner)

    def load_shards(self, shards: list[dict[str, Any]]) -> None:
        """The optimizer state of a data-parallel run with any number of processes, from the shards of all its
        ranks (each rank's `state_dict()`): joined into the one-process state, which this optimizer loads (cutting
        its own range under data parallelism) ([Note: shards of another world size])."""
        self.synchronize()
        self.load_state_dict(full_state_of_shards(shards, self.store, self.inner))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError("add parameter groups to the optimizer before engine.wrap_optimizer(...).")

    def __repr__(self) -> str:
        shard = f", {self.data_parallel}" if self.data_parallel is not None else ""
        return f"LaggedOptimizer(async={self.async_step}{shard}, {self.inner!r})"
