"""Gradient norms under RoundPipe: the exact norm for clipping, and a norm for logging that does not stall.

Gradients live on the engine's optimizer copies, not on `model.parameters()` (the compute copies), and they are
final only once the pass's backward finished. `clip_grad_norm_` over all of an engine's trainable parameters (what
the Trainer and stock loops pass) hands the clip to the engine's optimizer: the norm is this step's, exact, returned
as a tensor filled in when first read, and the step scales the gradients by the clip coefficient without a pipeline
drain ([Note: clipping without a drain]). Any other call (a subset of the parameters, another norm type, several
engines) maps the parameters to their optimizer copies, synchronizes and clips in place: exact too, at the price of
one drain.

[Note: late grad norm]
`transformers.Trainer` (5.x) logs a gradient norm every step even without clipping. Synchronizing for that alone
would drain the pipeline every step, so `LateGradNorm` measures the norm on the optimizer thread instead, as part of
the step (a step pre-hook of the user's optimizer runs around each bucket's step, on that bucket's stepper, and sees
its final gradients: [Note: one owner of the step's groups]), and the norm reported
at step k is the one of the newest step that has finished: k-1, or k-2 while the CPU is still stepping k-1 (waiting
for it would serialise the CPU step with the next iteration, which the staleness-1 optimizer exists to avoid; on an
H200 that wait cost a third of the throughput). Each step's groups are tagged with the step index so the
measurements of two steps never mix. Measuring is a pass over every gradient on the CPU (about 0.3 s for 1.7B
parameters), which made the CPU step outlast the GPU iteration when done every step, so `RoundPipeTrainer` measures
only the step before each step that logs (with `logging_steps=1`, every step: expect that cost).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch

from ..compat.torch_internals import foreach_norms
from ..runtime import RoundPipe, RoundPipeOptimizer
from .optimizer import optimizer_copy_map

STEP_TAG = "roundpipe_step_index"


def gradient_holders(parameters: Iterable[torch.Tensor], engines: list[RoundPipe],
                     maps: list[tuple[RoundPipe, dict]] | None = None) -> tuple[list, list[RoundPipe]]:
    """The tensors whose `.grad` holds the gradients of `parameters`, and the engines involved; `maps`: each
    engine's `optimizer_copy_map`, when the caller has them already."""
    maps = [(engine, optimizer_copy_map(engine)) for engine in engines] if maps is None else maps
    holders, involved = [], []
    for p in parameters:
        for engine, mapping in maps:
            if id(p) in mapping:
                p = mapping[id(p)]
                if engine not in involved:
                    involved.append(engine)
                break
        holders.append(p)
    return holders, involved


def _final_gradient_holders(parameters: Iterable[torch.Tensor], engines: list[RoundPipe], what: str) -> list:
    """`gradient_holders`, once the engines involved have finished every gradient in flight. Refused under data
    parallelism: there each rank's `.grad` is its share of the gradient (the ranks' shares are summed in the
    optimizer step, not in the backward as DDP does), so a clip over them would clip each share, not the global
    gradient, and the ranks would step apart from DDP's numbers."""
    holders, involved = gradient_holders(parameters, engines)
    world_size = max((engine.data_parallel_world_size for engine in involved), default=1)
    if world_size > 1:
        raise ValueError(
            f"{what} under data parallelism ({world_size} processes) would act on each rank's share of the "
            f"gradients: RoundPipe sums the ranks' gradients in the optimizer step, not in the backward, so it "
            f"cannot clip the global gradient that way. Clip with the L2 norm over all the model's trainable "
            f"parameters (`accelerator.clip_grad_norm_(model.parameters(), max_norm)`, the Trainer's "
            f"`max_grad_norm`), which is exact across ranks, or train in one process.")
    for engine in involved:
        engine.synchronize()
    return holders


def clip_grad_norm(parameters: Iterable[torch.Tensor], engines: list[RoundPipe], max_norm: float,
                   norm_type: float = 2.0) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` over the gradients RoundPipe really holds; returns the pre-clip norm."""
    parameters = list(parameters)
    optimizer = _whole_engine_optimizer(parameters, engines) if float(norm_type) == 2.0 else None
    if optimizer is not None:
        return optimizer.clip_grad_norm_(max_norm)
    what = f"clip_grad_norm_ with norm_type={norm_type}" if float(norm_type) != 2.0 else \
        "clip_grad_norm_ that no one engine's optimizer can take (some parameters, several engines, none wrapped)"
    return torch.nn.utils.clip_grad_norm_(_final_gradient_holders(parameters, engines, what), max_norm,
                                          norm_type=norm_type)


def _whole_engine_optimizer(parameters: list[torch.Tensor], engines: list[RoundPipe]) -> RoundPipeOptimizer | None:
    """The optimizer of the one engine whose trainable parameters `parameters` covers, all of them and
    nothing else that could hold a gradient; None when the clip must go the synchronous way."""
    maps = [(engine, optimizer_copy_map(engine)) for engine in engines]
    holders, involved = gradient_holders(parameters, engines, maps)
    if len(involved) != 1 or involved[0].optimizer is None:
        return None
    engine = involved[0]
    # The map's values are what `engine.named_parameters()` yields: read from it, not from another walk of the
    # model's modules (this runs at every step of the Trainer; requires_grad is read now, as it may change).
    mapping = next(mapping for each, mapping in maps if each is engine)
    trainable = {id(p) for p in mapping.values() if p.requires_grad}
    given = {id(h) for h in holders if h.requires_grad}
    return engine.optimizer if given == trainable else None


def clip_grad_value(parameters: Iterable[torch.Tensor], engines: list[RoundPipe], clip_value: float) -> None:
    torch.nn.utils.clip_grad_value_(_final_gradient_holders(parameters, engines, "clip_grad_value_"), clip_value)


class LateGradNorm:
    """The L2 gradient norm of each optimizer step, measured on the optimizer thread ([Note: late grad norm])."""

    def __init__(self, optimizer: RoundPipeOptimizer) -> None:
        self.optimizer = optimizer
        self._lock = threading.Lock()
        self._squares: dict[int, float] = {}  # step index -> sum of squared per-tensor norms
        self._seen: dict[int, int] = {}  # step index -> number of tensors measured
        self._expected = sum(len(g["params"]) for g in optimizer.param_groups)
        self._handle = optimizer.inner.register_step_pre_hook(self._measure)

    def before_step(self, step_index: int, measure: bool = True) -> None:
        """Tag the groups of the step about to be taken (the optimizer reads their settings at `step()`); with
        `measure=False` that step's norm is not computed (it costs a pass over every gradient on the CPU)."""
        for group in self.optimizer.param_groups:
            group[STEP_TAG] = step_index if measure else None

    def newest_norm(self, at_most: int) -> float | None:
        """The norm of the newest finished step <= `at_most`, without waiting; None if none has finished."""
        with self._lock:
            done = [k for k, seen in self._seen.items() if k <= at_most and seen >= self._expected]
            if not done:
                return None
            newest = max(done)
            self._forget_before(newest)
            return self._squares[newest] ** 0.5

    def _forget_before(self, step_index: int) -> None:
        """Drop the measurements of steps before `step_index` (call with the lock held): nobody asks for them."""
        for old in [k for k in self._squares if k < step_index]:
            self._squares.pop(old)
            self._seen.pop(old, None)

    def _measure(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        # Runs on the optimizer thread, inside one bucket's step: `optimizer` is that bucket's stepper, whose groups
        # hold the bucket's parameters (gradients final) and the step's settings, the tag included.
        if all(group.get(STEP_TAG) is None for group in optimizer.param_groups):
            return  # a step whose norm nobody will read
        count, step_index, sums = 0, None, []
        for group in optimizer.param_groups:
            step_index = group.get(STEP_TAG, step_index)
            count += len(group["params"])
            grads = [p.grad for p in group["params"] if p.grad is not None]
            if grads:  # one vectorised call per group (a bucket), not one reduction per tensor
                sums.append(torch.stack(foreach_norms(grads)).float().pow(2).sum())
        # Read once every group's reduction is queued: with gradients on a GPU each read waits for the device, and
        # the first wait then covers them all.
        squares = sum(float(s) for s in sums)
        if step_index is None:
            return
        with self._lock:
            self._squares[step_index] = self._squares.get(step_index, 0.0) + squares
            self._seen[step_index] = self._seen.get(step_index, 0) + count

    def close(self) -> None:
        self._handle.remove()
