"""One bucket of the host store: a flat buffer of parameters always uploaded together, with its optimizer copy and
gradient, and the gradient operations that run in its gradient turn (see `host_store.py` for what a bucket is).
"""

from __future__ import annotations

import math
import queue
from dataclasses import dataclass, field

import torch
from torch import nn

from ..common.sync import ReadWriteOrder, Sequencer
from .grad_buffers import GradBufferPool
from .tiers import HOST, StateTier
from .weight_versions import StepCount, WeightVersions


@dataclass
class ParamSlot:
    name: str
    param: nn.Parameter  # the user's parameter (its data is a view of bucket.compute)
    offset: int
    numel: int
    shape: torch.Size
    optim: nn.Parameter | None = None  # the optimizer copy (trainable only)
    # The dtype the parameter had before the store took it over: what a saved model holds ([Note: saved model dtype]).
    model_dtype: torch.dtype | None = None


@dataclass
class Bucket:
    index: int
    layers: tuple[int, ...]  # layers that use it
    trainable: bool
    compute: torch.Tensor
    optim: torch.Tensor | None
    # A host bucket holds a gradient buffer only while it holds gradients ([Note: no spare gradient buffer]).
    grad: torch.Tensor | None
    slots: list[ParamSlot]
    # Where a host bucket's gradient buffers come from and go back to ([Note: gradient swap]).
    grad_pool: GradBufferPool | None = field(default=None, repr=False)
    reads: ReadWriteOrder = field(default_factory=ReadWriteOrder)
    grads: Sequencer = field(default_factory=Sequencer)
    grad_valid: bool = False  # False after zero_grad(set_to_none=True): the next commit overwrites
    pending: torch.Tensor | None = None  # a deferred pass's gradients ([Note: deferred gradient commit])
    grad_sq: float | None = None  # squared L2 norm of `grad` when known without a host pass ([Note: device norms])
    # The windows committed since `grad` was last all zero, outside which it is still zero; None: unknown
    # ([Note: row windows]).
    written: list[tuple[int, int]] | None = None
    # The tier that owns `optim`, `grad` and the optimizer's state, asked for everything that differs between
    # tiers ([Note: state tiers]); set once, by `rehome`, before the optimizer's first step.
    tier: StateTier = field(default=HOST, repr=False)
    # Which copy holds which version, changed only through its transitions ([Note: weight versions]).
    versions: WeightVersions = field(init=False)
    # A bucket on a device: gradient buffers it let go of, for the next download to convert into, and the
    # optimizer's `.grad` views of its last two gradient buffers ([Note: device gradient buffers reused]).
    spare_grads: queue.SimpleQueue = field(default_factory=queue.SimpleQueue, repr=False)
    grad_views: list[tuple[torch.Tensor, list[torch.Tensor]]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self.versions = WeightVersions(self.compute, self.optim)

    @property
    def steps(self) -> StepCount:
        return self.versions.steps  # [Note: torn weights]

    @property
    def current_in_optim(self) -> bool:
        return self.versions.current_in_optim

    @property
    def stash(self) -> torch.Tensor | None:
        return self.versions.stash

    @property
    def new_versions_reserved(self) -> int:
        return self.versions.new_versions_reserved

    def current(self, newest: bool = False) -> torch.Tensor:
        return self.versions.current(newest)

    @property
    def home(self) -> torch.device | None:
        """Where `optim`, `grad` and the optimizer's state live: None for the host, else the bucket's home device
        ([Note: optimizer placement]); the tier's device."""
        return self.tier.device

    def __str__(self) -> str:
        kind = "trainable" if self.trainable else "frozen"
        return f"bucket{self.index}(layers {list(self.layers)}, {kind}, {self.compute.numel()} x {self.compute.dtype})"

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[s.offset:s.offset + s.numel].view(s.shape) for s in self.slots]

    def rehome(self, tier: StateTier, optim: torch.Tensor, grad: torch.Tensor,
               pending: torch.Tensor | None) -> None:
        """The optimizer copy, gradient and pending gradients now live in `tier`, on its device
        ([Note: optimizer placement], [Note: state tiers]): the optimizer's parameters (same objects) view the new
        copy."""
        self.tier = tier
        self.grad, self.pending = grad, pending
        self.point_optim(optim, resident=tier.optim_resident)
        if self.grad_valid:
            self._attach_grads()

    def point_optim(self, optim: torch.Tensor, resident: bool = True) -> None:
        """The optimizer copy's values now live in `optim` (the same values; or none, `resident=False`: a disk
        bucket's stand-in between its steps, [Note: disk tier]); the optimizer's parameters (same objects) view
        it. By whoever owns the bucket's optimizer copy now: the placement, or the disk tier in the bucket's
        gradient turn."""
        self.optim = optim
        for slot, view in zip(self.slots, self.views(optim)):
            slot.optim.data = view
        self.versions.moved_optim(optim, resident)

    def settle(self) -> None:
        """[Note: device steps are synchronous]
        Wait for the kernels this thread queued on the bucket's device. A bucket on a device is changed by several
        host threads (commits, the optimizer, zeroing) in the order its tickets give; each waits for its own
        kernels before its turn ends, so the next holder of the turn (on any thread and stream) and a reader
        uploading the optimizer copy find the work done, exactly as on the host. The cost is the kernels' own
        time (a layer's AdamW step on an H200 is well under a millisecond) on a background thread; nothing orders
        streams across threads, which would need an event per bucket and turn. A no-op for host buckets: the
        bucket's tier knows ([Note: state tiers])."""
        self.tier.settle()

    # The gradient operations below are the only writers of `grad`, `grad_valid` and `pending`; each runs in the
    # bucket's gradient turn (`grads`), on whichever host thread holds it.

    def commit(self, grad: torch.Tensor, grad_sq: float | None = None,
               window: tuple[int, int] | None = None) -> torch.Tensor:
        """Commit downloaded gradients (`grad_sq`: their squared norm, measured on the device): add them to a buffer
        that holds gradients, or swap the download in as the buffer of an empty one ([Note: gradient swap]); a
        `window` download (elements [start, stop): [Note: row windows]) goes into its rows. Returns the spare
        buffer nobody reads any more (None: a cleared host bucket held none)."""
        if window is not None and window != (0, self.optim.numel()):
            spare = self._commit_window(grad, grad_sq, window)
            self.settle()
            return spare
        if self.grad_valid:
            self.grad.add_(grad)
            self.settle()
            # [Note: device norms] a sum's norm is not the sum of norms, unless what was held was exactly zero.
            self.grad_sq = grad_sq if self.grad_sq == 0.0 else None
            self.written = None
            return grad
        spare, self.grad = self.grad, grad
        self.grad_valid = True
        self.grad_sq = grad_sq
        self.written = None
        self._attach_grads()
        return spare

    def _commit_window(self, grad: torch.Tensor, grad_sq: float | None, window: tuple[int, int]) -> torch.Tensor:
        start, stop = window
        if not self.grad_valid:  # the rows outside the window hold no gradient: zero them, once
            if self.grad is None:  # a cleared host bucket: a whole buffer from the pool
                self.grad = self.grad_pool.take(self.optim)
            self.grad[:start].zero_()
            self.grad[stop:].zero_()
            self.grad[start:stop].copy_(grad)
            self.grad_valid = True
            self.grad_sq, self.written = grad_sq, [window]
            self._attach_grads()
            return grad
        # [Note: device norms] norms add where the window held exactly zero: all zero, or outside every window
        # written since the buffer was last zero.
        if self.grad_sq == 0.0:
            self.written = []
        known_zero = self.written is not None and all(stop <= a or b <= start for a, b in self.written)
        self.grad[start:stop].add_(grad)
        self.grad_sq = self.grad_sq + grad_sq if known_zero and None not in (self.grad_sq, grad_sq) else None
        if self.written is not None:
            self.written.append(window)
        return grad

    def clear(self) -> None:
        """Forget the gradients (`zero_grad(set_to_none=True)`): `.grad` becomes None, the next commit overwrites; a
        host bucket gives its buffer back to the pool ([Note: no spare gradient buffer])."""
        self.grad_valid = False
        self.grad_sq = None
        self._detach_grads()
        if self.tier.gives_back_cleared_grads and self.grad is not None:
            buffer, self.grad = self.grad, None
            self.tier.return_spare(self, buffer)

    def zero(self) -> None:
        """Zero held gradients in place (`zero_grad(set_to_none=False)`)."""
        if self.grad_valid:
            self.grad.zero_()
            self.settle()
            self.grad_sq = 0.0
            self.written = []

    def scale(self, ratio: float) -> None:
        self.grad.mul_(ratio)
        self.settle()
        self.record_scale(ratio)

    def record_scale(self, ratio: float) -> None:
        """The optimizer's kernel multiplied the gradients by `ratio` as it read them ([Note: clip in the kernel])."""
        scaled = None if self.grad_sq is None else self.grad_sq * ratio * ratio
        # an infinite norm times a 0 coefficient is not the norm of what the gradients became: measure it again
        self.grad_sq = scaled if scaled is not None and math.isfinite(scaled) else None

    def squared_norm(self) -> float:
        """The squared L2 norm of the held gradients: the device's measurement when there is one, else a host
        pass over the buffer (0 without gradients)."""
        if not self.grad_valid:
            return 0.0
        if self.grad_sq is None:
            self.grad_sq = float(torch.linalg.vector_norm(self.grad)) ** 2
        return self.grad_sq

    def add_pending(self, grad: torch.Tensor, first: bool, window: tuple[int, int] | None = None) -> None:
        """Hold a deferred pass's gradients apart from `grad` until its scale is known; `first` starts the pass's
        sum, overwriting what an earlier pass left ([Note: deferred gradient commit]); `window`: the elements the
        download covers ([Note: row windows])."""
        start, stop = window or (0, self.optim.numel())
        if not first:
            self.pending[start:stop].add_(grad)
            self.settle()
            return
        if self.pending is None:
            self.pending = torch.empty_like(self.optim)  # the gradient's size, dtype and device
        self.pending[:start].zero_()
        self.pending[stop:].zero_()
        self.pending[start:stop].copy_(grad)
        self.settle()

    def commit_pending(self, ratio: float) -> None:
        self.grad.add_(self.pending, alpha=ratio)
        self.settle()
        self.grad_sq = None
        self.written = None

    def give_spare_grad(self, buffer: torch.Tensor) -> None:
        """[Note: device gradient buffers reused]
        A device bucket's gradients are converted into a fresh device buffer per task, which a commit then swaps
        in as the bucket's gradient (or adds, and lets go of). Allocating that buffer every step and making the
        optimizer's `.grad` view of every parameter of the new buffer (a slice and a view per parameter, on the
        path between the backward and the step) cost a small model's step about a millisecond a bucket. The buffer
        a commit lets go of (its kernels done: `settle`) is kept for the next download instead, so the bucket's
        gradient alternates between two buffers whose views are made once. One spare is kept; a second is freed."""
        if self.spare_grads.empty():
            self.spare_grads.put(buffer)

    def take_spare_grad(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A spare gradient buffer of `numel` elements of `dtype` (any thread: the queue is the hand-over), or None."""
        try:
            spare = self.spare_grads.get_nowait()
        except queue.Empty:
            return None
        return spare if spare.numel() == numel and spare.dtype == dtype else None

    def _grad_views(self) -> list[torch.Tensor]:
        if not self.tier.keeps_grad_views:  # host buffers come from a pool shared by every bucket: no views kept
            return self.views(self.grad)
        for buffer, views in self.grad_views:
            if buffer is self.grad:
                return views
        views = self.views(self.grad)
        self.grad_views = [(self.grad, views), *self.grad_views[:1]]
        return views

    def _attach_grads(self) -> None:
        assert self.grad is not None
        for slot, view in zip(self.slots, self._grad_views()):
            slot.optim.grad = view

    def _detach_grads(self) -> None:
        for slot in self.slots:
            slot.optim.grad = None
