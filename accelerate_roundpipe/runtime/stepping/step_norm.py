"""The global gradient norm of one optimizer step, known without draining the pipeline.

[Note: clipping without a drain]
`clip_grad_norm_` used to synchronize the engine, clip in place and return the norm: one pipeline drain per step,
which halved the Trainer's throughput at its default `max_grad_norm=1.0`. Now it only reserves, per bucket, a
gradient turn after the pass's commits: there the optimizer thread adds the bucket's squared norm (measured on the
device, [Note: device norms]) to a `StepNorm`. The step that follows scales each bucket's gradients by the clip
coefficient, computed exactly as `torch.nn.utils.clip_grad_norm_` does, before stepping it. The caller gets a
`PendingGradNorm` at once: a 0-dim tensor whose value is filled in (waiting if need be) the first time anything
reads it, so a Trainer that logs every `logging_steps` waits only on the steps that log, and only for the backward
of that step. With the lagged step nothing waits for the norm at all; with the exact one no bucket can step before
the whole backward is done, so the step goes bottom layers first (the order the next forward needs them).

[Note: non-finite clip]
A norm that is not finite clips as torch's does. torch measures it in the gradients' dtype: a float32 norm of
gradients around 1e20 is infinite (its sum of squares overflows), so the buckets' squares, summed here in float64,
count as infinite past that dtype's largest value. An infinite norm gives the coefficient 0 and the step multiplies
the gradients by it: zero, or NaN where a gradient is infinite, and the step goes on (AdamW then only decays). A NaN
norm gives a NaN coefficient (`torch.clamp` keeps NaN, where `min(1.0, nan)` would say 1.0 and skip the clip), and
every gradient becomes NaN, the layers without a NaN of their own too. Neither goes through the fused kernel's
`grad_scale` ([Note: clip in the kernel]): dividing by `1 / 0` or `1 / nan` is not torch's multiplication.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from ..common.sync import FailureFlag, Future

CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s


class StepNorm:
    """Sums the squared norms of one step's buckets into the global L2 norm. Every `add` runs on the optimizer's one
    thread, in its FIFO order, so the sum needs no lock; `norm` hands the result to other threads."""

    def __init__(self, num_buckets: int, max_norm: float, total: Callable[[float], float] | None = None,
                 dtype: torch.dtype = torch.float64) -> None:
        self.max_norm = float(max_norm)
        self._total = total  # the sum over data-parallel ranks of their squares ([Note: data parallel])
        self._largest = torch.finfo(dtype).max  # squares past it overflow in torch's norm ([Note: non-finite clip])
        self.norm = Future("the gradient norm of this step")
        self._left = num_buckets
        self._squares = 0.0
        if num_buckets == 0:
            self.norm.set(0.0)

    def add(self, square: float) -> None:
        self._squares += square
        self._left -= 1
        if self._left == 0:
            squares = self._total(self._squares) if self._total is not None else self._squares
            self.norm.set(math.inf if squares > self._largest else squares ** 0.5)

    def clip_coefficient(self, failure: FailureFlag) -> float:
        """`max_norm / (norm + 1e-6)` clamped to 1, as torch's `clip_grad_norm_` multiplies the gradients by: 0 for an
        infinite norm, NaN for a NaN one ([Note: non-finite clip])."""
        coefficient = self.max_norm / (self.norm.get(failure) + CLIP_EPS)
        return 1.0 if coefficient >= 1.0 else coefficient  # NaN stays NaN, as under torch.clamp


def kernel_grad_scale(coefficient: float) -> float | None:
    """The `grad_scale` a fused kernel divides the gradients by to multiply them by `coefficient`
    ([Note: clip in the kernel]); None where a division is not that multiplication: a coefficient of 0 or NaN
    ([Note: non-finite clip]), or one whose reciprocal overflows the kernel's float32 scale."""
    if not 0.0 < coefficient < 1.0:
        return None
    scale = 1.0 / coefficient
    return scale if scale <= torch.finfo(torch.float32).max else None


class PendingGradNorm(torch.Tensor):
    """A 0-dim tensor (in the gradients' dtype, as torch's clip returns) holding a step's gradient norm, resolved the
    first time it is used."""

    @staticmethod
    def __new__(cls, step_norm: StepNorm, failure: FailureFlag, dtype: torch.dtype) -> PendingGradNorm:
        tensor = torch.Tensor._make_subclass(cls, torch.zeros((), dtype=dtype))
        tensor._pending = (step_norm, failure)
        return tensor

    def resolve(self) -> torch.Tensor:
        """Fill in the norm (waiting for the backward if it is still running); returns a plain tensor of it."""
        pending = self.__dict__.pop("_pending", None)
        with torch._C.DisableTorchFunctionSubclass():
            if pending is not None:
                step_norm, failure = pending
                self.fill_(step_norm.norm.get(failure))
            return self.detach().clone()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for value in tree_leaves((args, kwargs)):
            if isinstance(value, PendingGradNorm):
                value.resolve()
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> torch.Tensor:
        return self.resolve()

    def __reduce_ex__(self, protocol: Any):
        return self.resolve().__reduce_ex__(protocol)

    def __repr__(self) -> str:
        return repr(self.resolve())

    def __format__(self, format_spec: str) -> str:
        # torch formats only an exact `torch.Tensor` of 0 dims as its number (`f"{norm:.3f}"`); a subclass would
        # get `object.__format__`, which takes no format
        return format(self.resolve(), format_spec)
