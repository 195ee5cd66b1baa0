"""The lagged CPU optimizer: any torch optimizer stepped bucket by bucket on a background thread.

[Note: one-step lag]
`step()` returns at once. A background thread steps each bucket (top layers first, the order their gradients become
final) as soon as its gradients are final, on the optimizer copies, then writes the compute copy. With
`async_optimizer=True` that write-back is held until the next iteration has reserved its reads, so iteration k
computes with the weights after steps 0..k-2 (staleness 1) while step k-1 runs beside it; with it off, the write
happens right after the step and iteration k waits for it, per bucket, seeing steps 0..k-1. Either way the
per-bucket tickets of [Note: per-layer events] keep every read and write in order; `synchronize()` releases held
write-backs, so `engine.module` then shows the newest weights.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from ..telemetry.trace import maybe_span
from . import faults
from .deferred import DeferredPasses
from .host_store import Bucket, HostStore
from .step_norm import PendingGradNorm, StepNorm
from .sync import FailureFlag, SerialExecutor

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
    Hyper-parameters (e.g. the learning rate an LR scheduler sets) are read when `step()` is called.
    """

    def __init__(self, inner: torch.optim.Optimizer, store: HostStore, failure: FailureFlag,
                 async_step: bool, deferred_passes: DeferredPasses | None = None, trace=None,
                 exact_steps_first: int = 0) -> None:
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
        self._clip: StepNorm | None = None  # the clip the next step() applies ([Note: clipping without a drain])
        self._check_params()
        prefer_fused(inner)
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
        # With a clip the exact step cannot start before the whole backward (the global norm): then the bottom
        # layers go first, in the order the next iteration's forward needs them ([Note: clipping without a drain]).
        order = self._step_order[::-1] if clip is not None and not lagged else self._step_order
        with self.failure.reserving("optimizer.step()"):  # [Note: interrupted reservations]
            for bucket in order:
                ticket = bucket.grads.reserve()
                self.thread.submit(self._step_job(bucket, ticket, member_groups, clip))
                if lagged:
                    self._held_writebacks.append(bucket)
                else:
                    self._submit_writeback(bucket)

    def clip_grad_norm_(self, max_norm: float) -> PendingGradNorm:
        """Clip the gradients of the next `step()` to a global L2 norm of `max_norm`, as
        `torch.nn.utils.clip_grad_norm_` would now; returns that norm as a tensor filled in when first read.
        Nothing waits for the backward here ([Note: clipping without a drain])."""
        self.failure.check()
        self._drop_pending_passes()
        if self._clip is not None:
            raise RuntimeError("clip_grad_norm_ was called twice before optimizer.step(); clip once per step.")
        step_norm = StepNorm(len(self._step_order), max_norm)
        with self.failure.reserving("clip_grad_norm_()"):  # [Note: interrupted reservations]
            for bucket in self._step_order:  # top layers first: the order their gradients become final
                ticket = bucket.grads.reserve()
                self.thread.submit(self._norm_job(bucket, ticket, step_norm))
        self._clip = step_norm
        dtype = self._step_order[0].optim.dtype if self._step_order else torch.float32
        return PendingGradNorm(step_norm, self.failure, dtype)

    def _norm_job(self, bucket: Bucket, ticket: int, step_norm: StepNorm) -> Callable[[], None]:
        def measure_bucket() -> None:
            bucket.grads.begin(ticket, self.failure, f"gradients of {bucket} for the gradient norm")
            try:
                with maybe_span(self.trace, "optimizer", f"norm layers {list(bucket.layers)}"):
                    step_norm.add(bucket.squared_norm())
            finally:
                bucket.grads.end(ticket)

        return measure_bucket

    def _step_job(self, bucket: Bucket, ticket: int, member_groups, clip: StepNorm | None) -> Callable[[], None]:
        ids = {id(s.optim) for s in bucket.slots}

        def step_bucket() -> None:
            bucket.grads.begin(ticket, self.failure, f"gradients of {bucket} for the optimizer step")
            try:
                faults.point("optimizer.step")
                groups = [dict(snap, params=[p for p in params if id(p) in ids]) for params, snap in member_groups]
                groups = [g for g in groups if g["params"]]
                if clip is not None and bucket.grad_valid:
                    coefficient = clip.clip_coefficient(self.failure)
                    if coefficient < 1.0:  # torch multiplies by the clamped coefficient; by 1 changes nothing
                        bucket.scale(coefficient)
                if groups and bucket.grad_valid:
                    original = self.inner.param_groups
                    self.inner.param_groups = groups
                    try:
                        with maybe_span(self.trace, "optimizer", f"step layers {list(bucket.layers)}"):
                            self.inner.step()
                    finally:
                        self.inner.param_groups = original
                bucket.optim_version_seen = bucket.optim._version
                bucket.steps.optim += 1  # [Note: torn weights]
            finally:
                bucket.grads.end(ticket)

        return step_bucket

    def _submit_writeback(self, bucket: Bucket) -> None:
        ticket = bucket.reads.reserve_write()

        def writeback() -> None:
            bucket.reads.begin_write(ticket, self.failure, f"readers of {bucket} before its write-back")
            try:
                faults.point("optimizer.writeback")
                with maybe_span(self.trace, "optimizer", f"write-back layers {list(bucket.layers)}"):
                    bucket.compute.copy_(bucket.optim)
                bucket.steps.compute = bucket.steps.optim
            finally:
                bucket.reads.end_write(ticket)

        self.thread.submit(writeback)

    def release_writebacks(self) -> None:
        """Reserve the held write-backs after the reads reserved so far (called by the engine)."""
        held, self._held_writebacks = self._held_writebacks, []
        with self.failure.reserving("a write-back"):  # [Note: interrupted reservations]
            for bucket in held:
                self._submit_writeback(bucket)

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

    def synchronize(self) -> None:
        self.release_writebacks()
        self.thread.wait_idle()
        self.failure.check()

    def close(self) -> None:
        self.thread.stop()

    # ------------------------------------------------------------------ torch.optim.Optimizer API

    def state_dict(self) -> dict[str, Any]:
        self.synchronize()
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.synchronize()
        self.inner.load_state_dict(state_dict)
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
        prefer_fused(self.inner)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError("add parameter groups to the optimizer before engine.wrap_optimizer(...).")

    def __repr__(self) -> str:
        return f"LaggedOptimizer(async={self.async_step}, {self.inner!r})"
