"""The CPU optimizer: any torch optimizer stepped bucket by bucket on a background thread, exactly by default or one
iteration late (`async_optimizer`).

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

import contextlib
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from ...compat.torch_internals import mark_stepped_for_scheduler
from ...telemetry.trace import maybe_span
from ..common import faults
from ..common.sync import FailureFlag, SerialExecutor
from ..distribution.shards import full_state_of_shards
from ..distribution.whole_buckets import WholeBuckets
from ..execution.deferred import DeferredPasses
from ..state.host_store import Bucket, HostStore
from ..stepping.clip import GradientClip
from ..stepping.step_norm import PendingGradNorm
from ..stepping.steppers import hyper_parameters, prefer_fused
from . import foreign_steps
from .step_policy import ExactStep, LaggedStep, StepSite
from .zeroing import zeroing_job


class RoundPipeOptimizer(torch.optim.Optimizer):
    """Steps the user's torch optimizer (built over `engine.parameters()`) bucket by bucket on the optimizer thread;
    see [Note: one-step lag].

    `param_groups` are the user's optimizer's (an LR scheduler's writes land there, on the caller's thread, and the
    next `step()` reads them); nothing on the optimizer thread touches the user's optimizer
    ([Note: one owner of the step's groups]). `state`, `state_dict()` and `load_state_dict()` are in the user's
    optimizer's format; under data parallelism they are this rank's shard's ([Note: data parallel]). The layout
    (`WholeBuckets` on one process, `ShardedSteps` under data parallelism) says how each bucket's gradients are
    exchanged, measured and stepped.
    """

    def __init__(self, inner: torch.optim.Optimizer, store: HostStore, failure: FailureFlag,
                 async_step: bool, deferred_passes: DeferredPasses | None = None, trace=None,
                 exact_steps_first: int = 0, layout_of: Callable | None = None,
                 replaces: RoundPipeOptimizer | None = None, before_step: Callable[[], None] | None = None) -> None:
        # Not calling Optimizer.__init__: the groups stay the user's optimizer's own objects.
        self.inner = inner
        self.defaults = inner.defaults
        self.param_groups = inner.param_groups
        self._optimizer_step_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._zero_grad_profile_name = "Optimizer.zero_grad#RoundPipeOptimizer.zero_grad"
        self.store = store
        self.failure = failure
        self.async_step = async_step
        self.exact_steps_first = exact_steps_first  # an async warm-up: the first steps are exact
        self.steps_taken = 0
        self.before_step = before_step  # the engine's: [Note: weight edits followed]
        self._deferred_passes = deferred_passes  # passes never back-propagated are dropped before gradients are used
        self.trace = trace
        self._held_writebacks: list[Bucket] = []  # write-backs held until the next iteration reserved its reads
        # Whether a look showed every held step ([Note: held steps shown on the caller's thread]).
        self._holds_shown = True
        self._stale_compute: dict[int, Bucket] = {}  # exact steps not yet written back
        self._clip: GradientClip | None = None  # the clip the next step() applies ([Note: clipping without a drain])
        self._check_params()
        prefer_fused(inner)  # before the layout copies the groups' settings
        # How this process steps its buckets: whole, or its shard of them ([Note: data parallel]).
        self.layout = layout_of(inner) if layout_of is not None else WholeBuckets(inner, store)
        self._exact, self._lagged = ExactStep(), LaggedStep()
        self._tiers = list({id(b.tier): b.tier for b in store.trainable_buckets}.values())
        for tier in self._tiers:  # [Note: state tiers]: a tier keeping no state in memory finds it here
            tier.attach(lambda: self.layout.state, trace)
        self._tiers_take_state()  # a state the user's optimizer held, loaded by the layout
        self.thread = SerialExecutor(failure, "roundpipe-optimizer")
        self.step_order = store.trainable_in_backward_order
        # [Note: optimizers the engine does not step]: the groups the steppers step; whether a later one replaced it
        self.stepped_groups, self.replaced = foreign_steps.groups_of(self.param_groups, inner.param_groups), False
        if replaces is not None:  # the engine's previous optimizer (`wrap_optimizer`), once this one is built
            replaces.close(replaced=True)

    @property
    def state(self) -> dict:
        return self.layout.state

    @state.setter
    def state(self, value: dict) -> None:
        raise AttributeError("the optimizer state is the engine's: load it with optimizer.load_state_dict(...)")

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
            raise ValueError("RoundPipe's optimizer takes no closure: the step runs in the background after the "
                             "pipeline; call engine.forward_backward(...) then optimizer.step().")
        self.failure.check()
        foreign_steps.check_in_charge(self, step=True)
        if self.before_step is not None:  # the engine's: [Note: weight edits followed]
            self.before_step()
        self.follow_user_grads()
        # [Note: scheduler step count]; first, so that a library check failing in it leaves nothing half-stepped
        mark_stepped_for_scheduler(self.inner)
        self._drop_pending_passes()
        # [Note: write-backs held for the whole iteration]
        # A lagged step's write-back is released here, at the next step, after every pass of the iteration in
        # between reserved its reads: all of them compute with the same weights (after steps 0..k-2), as the
        # staleness-1 rule says, with gradient accumulation too. Released at the next pass instead (as before),
        # the first pass of an accumulation read the older weights and the later ones the newer, so one step's
        # gradient mixed two versions. It also reads the optimizer copy this step overwrites: it goes first.
        self.release_writebacks()
        hyper = hyper_parameters(self.param_groups)  # read now ([Note: one owner of the step's groups])
        clip, self._clip = self._clip, None
        policy = self._lagged if self.async_step and self.steps_taken >= self.exact_steps_first else self._exact
        self.steps_taken += 1
        with self.failure.reserving("optimizer.step()"):  # [Note: interrupted reservations]
            policy.schedule(self._step_site(), hyper, clip)

    def _step_site(self) -> StepSite:
        """What a step policy drives of this optimizer (its buckets, its thread, its steps and write-backs)."""
        return StepSite(self.step_order, self.failure, self.layout.fixed_order, self.thread.submit, self._exact_steps,
                        self._step_buckets, self.stepped_without_write_back, self.write_back_stale,
                        self.hold_writeback)

    # [Note: scheduler step count]
    # A torch LR scheduler wraps its optimizer's `step` (an attribute of that instance) to set `_opt_called`, and its
    # own `step()` warns "lr_scheduler.step() before optimizer.step()" when that is unset. The wrapped optimizer's
    # step runs later, on the optimizer thread, so `step()` says on the caller's thread what torch's wrapper would
    # say there: the step is taken (scheduled, with the learning rates read now). The optimizer thread calls the
    # class's `step` (its hooks included) on the bucket's stepper, not the instance's, so it never writes to the
    # user's optimizer, whatever a scheduler wrapped around it.

    def clip_grad_norm_(self, max_norm: float) -> PendingGradNorm:
        """Clip the gradients of the next `step()` to a global L2 norm of `max_norm`, as
        `torch.nn.utils.clip_grad_norm_` would now; returns that norm as a tensor filled in when first read.
        Nothing waits for the backward here ([Note: clipping without a drain])."""
        self.failure.check()
        foreign_steps.check_in_charge(self)
        self._drop_pending_passes()
        self.follow_user_grads()
        if self._clip is not None:
            raise RuntimeError(
                "clip_grad_norm_ was called twice before optimizer.step() took a step; clip once per step. With "
                "gradient accumulation (accelerator.accumulate), clip on the last micro-batch of each window only, "
                "`if accelerator.sync_gradients: accelerator.clip_grad_norm_(...)`: that clip acts on the whole "
                "window's gradients (a clip of each micro-batch's partial sum is not supported).")
        clip = GradientClip(max_norm, self.step_order, self.layout, self.failure, self.trace)
        with self.failure.reserving("clip_grad_norm_()"):  # [Note: interrupted reservations]
            # top layers first: the order their gradients become final
            self.thread.submit(clip.measure_job([(bucket, bucket.grads.reserve()) for bucket in self.step_order]))
        self._clip = clip
        return clip.pending_norm()

    def _step_buckets(self, turns: list[tuple[Bucket, int]], hyper: list[dict[str, Any]],
                      clip: GradientClip | None, current_for_readers: bool = False) -> None:
        """Step the buckets of `turns` (bucket, gradient turn; usually one) in their gradient turns, clipped by
        `clip`, with the hyper-parameters `hyper` that `step()` read; with `current_for_readers` (an exact step, in
        the buckets' write turns) the next readers read the new version in the optimizer copy
        ([Note: weight versions]). Several buckets go in one optimizer call where that is exact
        ([Note: device steps in one call])."""
        begun: list[tuple[Bucket, int]] = []
        try:
            for bucket, ticket in turns:
                bucket.grads.begin(ticket, self.failure, f"gradients of {bucket} for the optimizer step")
                begun.append((bucket, ticket))
            self.failure.check()  # a turn ended by a failed commit is not a gradient to step with
            faults.point("optimizer.step")
            for bucket, _ in begun:  # a tier whose state is not resident brings it in ([Note: state tiers])
                bucket.tier.before_step(bucket)
            stepping, scales, with_gradient = [], [], set()
            for bucket, ticket in begun:
                # the same answer on every rank under data parallelism ([Note: parameters no rank reaches])
                if self.layout.has_gradient(bucket, ticket):
                    with_gradient.add(bucket.index)
                    self.layout.prepare_step(bucket, ticket)
                    groups = self.layout.steppers.groups(bucket, hyper)
                    scale = clip.apply(bucket, groups) if clip is not None else None
                    if groups:
                        stepping.append(bucket)
                        scales.append(scale)
            if stepping:
                self._run_steps(stepping, scales, hyper)
            for bucket, _ in begun:
                if bucket.index in with_gradient:
                    self.layout.finish_step(bucket)
                # readers read the optimizer copy only where it stays in memory ([Note: state tiers]); where it
                # does not, an exact step is written into the compute copy now, in its write turn, and a lagged
                # one kept apart for its held write-back
                resident = bucket.tier.optim_resident
                bucket.versions.step_written(current_for_readers and resident)
                if not resident:
                    if current_for_readers:
                        bucket.versions.write_back()
                    else:
                        bucket.versions.hold_newest()
                bucket.tier.after_step(bucket)
        finally:
            for bucket, ticket in begun:
                bucket.grads.end(ticket)

    def _run_steps(self, buckets: list[Bucket], scales: list[float | None], hyper: list[dict[str, Any]]) -> None:
        """[Note: device steps in one call]
        The optimizer's step over `buckets` (each with the `grad_scale` of its clip), then a wait for their
        devices' kernels ([Note: device steps are synchronous]). Device buckets whose gradients are final together
        go in one call, one kernel and one wait, where the optimizer is element-wise (the same result as one call
        each): with clipping all are final at once, after the backward, and stepped one by one on the 168M preset
        they took 26 ms between two iterations, mostly waiting for the GIL (each torch call releases it; other
        threads' Python kept it up to the 5 ms switch interval), for 0.1 ms of kernels."""
        steppers = self.layout.steppers
        names = ", ".join(str(list(b.layers)) for b in buckets)
        with maybe_span(self.trace, buckets[0].tier.track, "step layers " + names), \
                foreign_steps.engine_steps():  # our steppers' ([Note: optimizers the engine does not step])
            if len(buckets) > 1 and len(set(scales)) == 1 and steppers.steps_together:
                steppers.step_together(buckets, hyper, scales[0])
            else:
                for bucket, scale in zip(buckets, scales):
                    steppers.step(bucket, hyper, scale)
            for tier in {id(b.tier): b.tier for b in buckets}.values():  # once per device ([Note: state tiers])
                tier.settle()

    def _write_back(self, bucket: Bucket, ticket: int) -> None:
        """Write the optimizer copy into the compute copy, in write turn `ticket`."""
        bucket.reads.begin_write(ticket, self.failure, f"readers of {bucket} before its write-back")
        try:
            faults.point("optimizer.writeback")
            with maybe_span(self.trace, "optimizer", f"write-back layers {list(bucket.layers)}"):
                bucket.versions.write_back()
        finally:
            bucket.reads.end_write(ticket)

    # [Note: exact step without write-back]
    # An exact step (`ExactStep`) writes the version its readers wait for straight into the optimizer copy, in the
    # bucket's write turn, and the next uploads read that copy, cast to the compute dtype on the device. There is no
    # write-back pass on the host: on one H200 (Qwen3-1.7B) the host step was the slower side of the exact
    # iteration (about 21 ms a layer against a 14 ms backward), and the write-back was a quarter of it; the
    # device casts in microseconds what costs the host a pass over every weight. The uploads carry the optimizer
    # dtype (twice the bytes from float32 to bfloat16), which the copy engine overlaps with the step. The compute
    # copies (what `engine.module` shows) are written only when someone on the host looks (`synchronize()`,
    # checkpoints, `state_dict()`) and before a lagged step, which writes the optimizer copies outside the read
    # tickets: `write_back_stale`.

    def _exact_steps(self, entries: list[tuple[Bucket, int, int]], hyper: list[dict[str, Any]],
                     clip: GradientClip | None) -> None:
        """Step the buckets of `entries` (bucket, gradient turn, write turn) in their write turns, where the next
        uploads read them ([Note: exact step without write-back])."""
        writes: list[tuple[Bucket, int]] = []
        try:
            for bucket, _, write_ticket in entries:
                bucket.reads.begin_write(write_ticket, self.failure, f"readers of {bucket} before its exact step")
                writes.append((bucket, write_ticket))
            self._step_buckets([(bucket, grad_ticket) for bucket, grad_ticket, _ in entries], hyper, clip, True)
        finally:
            for bucket, write_ticket in writes:
                bucket.reads.end_write(write_ticket)

    def stepped_without_write_back(self, buckets: list[Bucket]) -> None:
        """`buckets` got an exact step whose compute copies are not written yet. A bucket on a device is written
        only when someone looks (`synchronize`): its readers read the device's copy ([Note: state tiers])."""
        self._stale_compute.update((bucket.index, bucket) for bucket in buckets
                                   if bucket.tier.stale_compute_after_exact_step)

    def hold_writeback(self, bucket: Bucket) -> None:
        """`bucket` got a lagged step whose write-back waits for the next iteration's reads (at `step()`, on the
        caller's thread, before the step itself runs)."""
        self._held_writebacks.append(bucket)
        self._holds_shown = False

    def write_back_after_failure(self, timeout_s: float = 10.0) -> None:
        """After a failure: once the optimizer thread has no job left (they are skipped or aborted at once), write
        the exact steps' optimizer copies into the compute copies, so a failed engine's module shows the step its
        layers all reached ([Note: torn weights], [Note: exact step without write-back])."""
        from ..state.torn import TornWeightsError

        deadline = time.monotonic() + timeout_s
        while not self.thread.idle:
            if time.monotonic() > deadline:
                raise TornWeightsError("the RoundPipe engine failed and its optimizer thread did not stop within "
                                       f"{timeout_s:g} s, so its newest weights cannot be written into the model.")
            time.sleep(0.01)
        for bucket in self.store.trainable_buckets:
            if bucket.current_in_optim:
                bucket.versions.write_back()

    def write_back_stale(self) -> None:
        """Queue the write-backs of the exact steps not written back yet ([Note: exact step without write-back])."""
        stale, self._stale_compute = self._stale_compute, {}
        for bucket in stale.values():
            self._submit_writeback(bucket, new_version=False)  # the version readers get already: no change

    def _submit_writeback(self, bucket: Bucket, new_version: bool) -> None:
        ticket = bucket.reads.reserve_write()
        if new_version:
            bucket.versions.reserve_new_version()
        self.thread.submit(lambda: self._write_back(bucket, ticket))

    def release_writebacks(self) -> None:
        """Reserve the held write-backs after the reads reserved so far, at `step()`:
        [Note: write-backs held for the whole iteration]."""
        held, self._held_writebacks = self._held_writebacks, []
        with self.failure.reserving("a write-back"):  # [Note: interrupted reservations]
            for bucket in held:
                self._submit_writeback(bucket, new_version=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.failure.check()
        foreign_steps.check_in_charge(self)
        self._drop_pending_passes()
        self._clip = None  # a clip measured gradients that are gone now
        self.follow_user_grads()
        with self.failure.reserving("zero_grad()"):  # [Note: interrupted reservations]
            self._reserve_zeroing(set_to_none)

    def follow_user_grads(self) -> None:
        """Apply what the user set as the optimizer copies' `.grad` since the engine last did (`p.grad = None`,
        `p.grad = t`), in program order: in gradient turns reserved now, after what was queued before
        ([Note: parameters without a gradient]). On the caller's thread, at each call that uses gradients."""
        changed = [(bucket, changes) for bucket in self.step_order if (changes := bucket.user_grad_changes())]
        if not changed:
            return
        with self.failure.reserving("the user's changes of `.grad`"):  # [Note: interrupted reservations]
            turns = [(bucket, bucket.grads.reserve(), changes) for bucket, changes in changed]
            submit = self.thread.submit if self._deferred_passes is None else self._deferred_passes.submit
            submit(lambda: self._apply_user_grads(turns))

    def _apply_user_grads(self, turns: list[tuple[Bucket, int, dict]]) -> None:
        for bucket, ticket, changes in turns:
            self.failure.check()
            bucket.grads.begin(ticket, self.failure, f"gradients of {bucket} for the user's changes of `.grad`")
            try:
                bucket.apply_user_grads(changes)
            finally:
                bucket.grads.end(ticket)

    def _reserve_zeroing(self, set_to_none: bool) -> None:
        """Each bucket cleared (or zeroed) in a turn after its step, as soon as it is stepped, beside the optimizer
        thread ([Note: zeroing as each bucket is stepped])."""
        turns = [(bucket, bucket.grads.reserve()) for bucket in self.step_order]
        submit = self.thread.submit if self._deferred_passes is None else self._deferred_passes.submit
        submit(zeroing_job(turns, set_to_none, self.failure))

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
        # The held buckets' lagged steps are done, and the write-backs released before them, which drop the stash
        # of an earlier look (`show_newest` below keeps a bucket's stash as it finds it).
        self.thread.wait_idle()
        for bucket in self._held_writebacks:
            bucket.versions.show_newest()
        self._holds_shown = True

    @property
    def has_held_steps(self) -> bool:
        """[Note: held steps shown on the caller's thread]
        Lagged steps whose newest weights the compute copies do not show yet. Answered from what the caller's
        thread did (a `step()` holding write-backs, a look showing them), never from the buckets' stashes: those
        change on the optimizer thread. Asked of the stashes, an evaluation right after `step()` that came after an
        earlier look found the earlier look's stash still there (the released write-back that drops it had not run
        yet), took the new step as shown and read the weights one step old: every other evaluation of a run that
        evaluated each step, whenever the host step was slower than the caller (tests/test_lagged_evaluation.py)."""
        return bool(self._held_writebacks) and not self._holds_shown

    def hold_shown(self, buckets: list[Bucket]) -> None:
        """Hold the write-backs of `buckets`, whose stashes a checkpoint restored: the next training pass reads
        the stash, then the write-back drops it, as after a look ([Note: looking changes nothing])."""
        for bucket in buckets:
            if bucket not in self._held_writebacks:
                self._held_writebacks.append(bucket)

    def resume_steps(self, steps_taken: int) -> None:
        """A checkpoint's step count (where an async warm-up stands), on the caller's thread after a synchronize."""
        self.steps_taken = steps_taken

    def forget_stashes(self) -> None:
        """The compute copies were loaded from outside: the next pass reads them, not a stash."""
        for bucket in self._held_writebacks:
            bucket.versions.forget_stash()
        self._holds_shown = False  # as the stashes say now: a look shows the held steps again

    def wait_for_steps(self) -> None:
        """Wait for every step queued so far and no more: the compute copies stay as the steps left them (no look,
        no write-back), as in a training loop's steady state; the engine waits for the passes in flight first."""
        self.thread.wait_idle()
        self.failure.check()

    def synchronize(self) -> None:
        """Wait for every step and show the newest weights in the compute copies, and a clip measured for the next
        step in the gradients ([Note: a clip applied by a look]); the engine waits for the passes in flight first."""
        self.write_back_stale()
        self.thread.wait_idle()
        clip, self._clip = self._clip, None
        if clip is not None:  # its measurement is done: the optimizer thread is idle
            clip.apply_now(self.step_order)
        self.show_newest()
        self.failure.check()
        for bucket in self.store.trainable_buckets:  # the optimizer thread is idle: the device's copies are final
            bucket.tier.on_look(bucket)

    def close(self, replaced: bool = False) -> None:
        self.replaced = self.replaced or replaced  # by a later optimizer: calls are refused from now on
        self.thread.stop()

    def release(self) -> None:
        """The engine closed and this thread stopped: the layout lets go of the state
        ([Note: memory freed at close]); `param_groups` stay the user's optimizer's."""
        self.layout.release()
        self._held_writebacks.clear()
        self._stale_compute.clear()

    # ------------------------------------------------------------------ torch.optim.Optimizer API

    def state_dict(self) -> dict[str, Any]:
        """The user's optimizer's state dict (its format); under data parallelism this rank's shard of it, with the
        world size, the rank and the shard layout ([Note: data parallel]). A tier that keeps its buckets' state
        outside memory shows it in the state for the call ([Note: disk tier])."""
        self.synchronize()
        with contextlib.ExitStack() as shown:
            for bucket in self.store.trainable_buckets:
                shown.enter_context(bucket.tier.showing_state(bucket, self.layout.state))
            state_dict = self.layout.state_dict()
            if "state" not in state_dict or all(tier.optim_resident for tier in self._tiers):
                return state_dict
            # each parameter's entries as shown now: the tier takes its own back out of the live state after
            return {**state_dict, "state": {key: dict(entry) for key, entry in state_dict["state"].items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A state dict as `state_dict()` saved it; under data parallelism this rank's shard (same world size) or a
        one-process state dict, which each rank cuts to its shard."""
        self.synchronize()
        self.layout.load_state_dict(state_dict)
        self._tiers_take_state()

    def _tiers_take_state(self) -> None:
        """The state just loaded: each bucket's entries to where its tier keeps them ([Note: state tiers])."""
        for bucket in self.store.trainable_buckets:
            bucket.tier.take_state(bucket, self.layout.state)

    def load_shards(self, shards: list[dict[str, Any]]) -> None:
        """The optimizer state of a data-parallel run with any number of processes, from the shards of all its
        ranks (each rank's `state_dict()`): joined into the one-process state, which this optimizer loads (cutting
        its own range under data parallelism) ([Note: shards of another world size])."""
        self.synchronize()
        self.load_state_dict(full_state_of_shards(shards, self.store, self.inner))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError("add every parameter group to the optimizer before handing it to RoundPipe "
                                  "(`accelerator.prepare(model, optimizer)` / `engine.wrap_optimizer(optimizer)`).")

    def __repr__(self) -> str:
        return f"RoundPipeOptimizer(async={self.async_step}, {self.layout!r}, {self.inner!r})"


LaggedOptimizer = RoundPipeOptimizer  # its name before it stepped exactly by default
