"""The clip of one optimizer step: measures the global gradient norm per bucket, then scales each bucket's gradients
by torch's clip coefficient as it is stepped ([Note: clipping without a drain] in `step_norm.py`).

[Note: clip in the kernel]
Whether torch's fused Adam/AdamW applies the clip itself: its kernel divides each gradient by `grad_scale` as it
reads it (the hook `GradScaler` uses) and leaves the divided gradient in `.grad`, as a clip would. A separate
scaling pass over the gradients cost 4-5 ms a layer on the host of an exact, clipped step, whose whole host step sits
between two iterations. The kernel reads the scale in float32, so this serves float32 gradients only (the scale's
rounding is then that of the gradients'); float64 keeps the exact pass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...telemetry.trace import maybe_span
from ..common.sync import FailureFlag
from ..state.host_store import Bucket
from .step_norm import PendingGradNorm, StepNorm, kernel_grad_scale
from .steppers import FUSED_CPU


class GradientClip:
    """One step's clip to a global L2 norm of `max_norm`, over the buckets `step_order` of a layout (`WholeBuckets`
    or `ShardedSteps`, which say how a bucket's gradients are measured and scaled)."""

    def __init__(self, max_norm: float, step_order: list[Bucket], layout, failure: FailureFlag, trace=None) -> None:
        self.layout = layout
        self.failure = failure
        self.trace = trace
        self.dtype = step_order[0].optim.dtype if step_order else torch.float32
        self.norm = StepNorm(len(step_order), max_norm, layout.total_norm, self.dtype)

    def pending_norm(self) -> PendingGradNorm:
        """The norm, as a tensor filled in when first read."""
        return PendingGradNorm(self.norm, self.failure, self.dtype)

    def measure_job(self, turns: list[tuple[Bucket, int]]) -> Callable[[], None]:
        """The optimizer thread's job: add each bucket's squared norm, in order, in its gradient turn (`turns`:
        bucket, turn, top layers first). One job for every bucket, not one each: they are queued together, so
        nothing else ever ran between them, and a job each cost the optimizer thread a queue hand-over and a wake
        per bucket between the backward and the step, which a clip waits for whole."""
        def measure_buckets() -> None:
            for bucket, ticket in turns:
                self.failure.check()  # a failure stops the measuring as it skipped the jobs queued after it
                bucket.grads.begin(ticket, self.failure, f"gradients of {bucket} for the gradient norm")
                try:
                    square = self.layout.squared_norm(bucket, ticket)
                    with maybe_span(self.trace, "optimizer", f"norm layers {list(bucket.layers)}"):
                        self.norm.add(square)
                finally:
                    bucket.grads.end(ticket)

        return measure_buckets

    def apply(self, bucket: Bucket, groups: list[dict[str, Any]]) -> float | None:
        """Scale `bucket`'s gradients for its step (in its gradient turn, on the optimizer thread); returns the
        `grad_scale` the fused kernel is to divide by instead ([Note: clip in the kernel]), or None."""
        coefficient = self.norm_coefficient()
        # torch multiplies by the clamped coefficient (0 or NaN too: [Note: non-finite clip]); by 1 changes nothing
        if coefficient == 1.0:
            return None
        scale = kernel_grad_scale(coefficient)
        if groups and scale is not None and self._in_kernel(bucket, groups):
            self.layout.scaled_in_kernel(bucket, coefficient)
            return scale
        self.layout.scale(bucket, coefficient)
        return None

    def apply_now(self, buckets: list[Bucket]) -> None:
        """[Note: a clip applied by a look]
        `clip_grad_norm_` only measures; its scale is applied as each bucket is stepped
        ([Note: clipping without a drain]). A look before `step()` (`synchronize()`, which every synchronous reader
        of gradients goes through: `clip_grad_value_`, a clip of another norm type, the user reading `p.grad`)
        would show the gradients unclipped, and a value clip would cut them before the norm scaled them, where
        torch scales first: the weights then left torch's from the next step on. So a look applies the clip now, as
        torch does at `clip_grad_norm_`: every bucket's gradients multiplied in place by the clamped coefficient,
        while nothing runs (the look's precondition, as for `show_newest`: no pass in flight, the optimizer thread
        idle, so no gradient turn is open); the step then applies no clip. The same numbers as torch's, to the
        rounding of a multiply instead of the fused kernel's division ([Note: clip in the kernel])."""
        coefficient = self.norm_coefficient()
        if coefficient == 1.0:
            return
        for bucket in buckets:
            if self.layout.holds_gradient(bucket):
                self.layout.scale(bucket, coefficient)

    def norm_coefficient(self) -> float:
        return self.norm.clip_coefficient(self.failure)

    def _in_kernel(self, bucket: Bucket, groups: list[dict[str, Any]]) -> bool:
        return (isinstance(self.layout.owner, FUSED_CPU) and bucket.grad.dtype == torch.float32
                and all(g.get("fused") for g in groups))
