"""One bucket of the host store: a flat buffer of parameters always uploaded together, with its optimizer copy and
gradient, and the gradient operations that run in its gradient turn (see `host_store.py` for what a bucket is).
"""

from __future__ import annotations

import math
import queue
import threading
from dataclasses import dataclass, field

import torch
from torch import nn

from ..common.sync import ReadWriteOrder, Sequencer
from .grad_buffers import GradBufferPool
from .tiers import HOST, StateTier, stand_in
from .weight_versions import StepCount, WeightVersions


@dataclass
class ParamSlot:
    name: str
    param: nn.Parameter  # the user's parameter (its data is a view of bucket.compute)
    offset: int
    numel: int
    shape: torch.Size
    optim: nn.Parameter | None = None  # the optimizer copy (trainable only)
    # The same elements as `optim` under another tensor, which the engine's steppers step: its `.grad` is set by
    # the bucket alone, so what the user does to `optim.grad` meanwhile never reaches a step in flight
    # ([Note: parameters without a gradient]).
    twin: nn.Parameter | None = None
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
    # Which slots hold a gradient while `grad_valid` (the others' `.grad` is None), which the pending gradients
    # reach, and the `.grad` each slot was given, to see what the user changed
    # ([Note: parameters without a gradient]).
    grad_slots: set[int] = field(default_factory=set, repr=False)
    pending_slots: set[int] = field(default_factory=set, repr=False)
    attached: list[torch.Tensor | None] = field(default_factory=list, repr=False)
    # Held while `attached` and the `.grad` attributes are written or compared (a commit thread and the caller's).
    grads_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # `grad`'s version counter when `grad_sq` and `written` were last true of it: a write by anyone else (the user's
    # `p.grad.mul_`, `clip_grad_value_`) shows as another version ([Note: parameters without a gradient]).
    grad_version: int = field(default=-1, repr=False)
    # A frozen bucket's compute copy as the user last changed it: counted up (`content_changed`, by the caller's
    # thread at a pass's launch) when one of its parameters was changed in place, so a device copy of an older
    # count is not shared with a later task ([Note: shared frozen weights]); read by the workers.
    content_generation: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        self.versions = WeightVersions(self.compute, self.optim)
        self.all_slots = frozenset(range(len(self.slots)))

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

    def content_changed(self) -> None:
        """The user changed a parameter of this frozen bucket in place ([Note: shared frozen weights])."""
        self.content_generation += 1

    @property
    def home(self) -> torch.device | None:
        """Where `optim`, `grad` and the optimizer's state live: None for the host, else the bucket's home device
        ([Note: optimizer placement]); the tier's device."""
        return self.tier.device

    def __str__(self) -> str:
        kind = "trainable" if self.trainable else "frozen"
        return f"bucket{self.index}(layers {list(self.layers)}, {kind}, {self.compute.numel()} x {self.compute.dtype})"

    def release(self) -> None:
        """The engine closed, its threads stopped: let go of the optimizer copy, the gradients and their spare
        buffers ([Note: memory freed at close]). The compute copy stays: the user's module views it. The optimizer
        copy's parameters, which the user's optimizer holds, keep their shape and dtype over one element of memory,
        as a disk bucket's do between its steps."""
        with self.grads_lock:
            if self.optim is not None:  # the user's optimizer holds the parameters: their shapes, no memory
                self.point_optim(stand_in(self.optim.numel(), self.optim.dtype), resident=False)
            for slot in self.slots:
                for param in (slot.optim, slot.twin):
                    if param is not None:
                        param.grad = None
                slot.optim = slot.twin = None
            self.optim = self.grad = self.pending = None
            self.grad_valid = False
            self.grad_views.clear()
            self.attached.clear()
            while not self.spare_grads.empty():
                self.spare_grads.get_nowait()
        self.versions.release()

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
            slot.twin.data = view
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

    # The gradient operations below are the only writers of `grad`, `grad_valid`, `grad_slots` and `pending`; each
    # runs in the bucket's gradient turn (`grads`), on whichever host thread holds it.

    def commit(self, grad: torch.Tensor, grad_sq: float | None = None,
               window: tuple[int, int] | None = None, used: frozenset[int] | None = None) -> torch.Tensor:
        """Commit downloaded gradients (`grad_sq`: their squared norm, measured on the device; `used`: the slots
        the backward reached, None for all): add them to a buffer that holds gradients, or swap the download in as
        the buffer of an empty one ([Note: gradient swap]); a `window` download (elements [start, stop):
        [Note: row windows]) goes into its rows. Returns the spare buffer nobody reads any more (None: a cleared
        host bucket held none)."""
        self._check_version()
        used = self.all_slots if used is None else used
        if window is not None and window != (0, self.optim.numel()):
            spare = self._commit_window(grad, grad_sq, window, used)
            self.settle()
            return spare
        if self.grad_valid:
            self.grad.add_(grad)
            self.settle()
            # [Note: device norms] a sum's norm is not the sum of norms, unless what was held was exactly zero.
            self.grad_sq = grad_sq if self.grad_sq == 0.0 else None
            self.written = None
            self._reach(used)
            return grad
        spare, self.grad = self.grad, grad
        self.grad_valid = True
        self.grad_sq = grad_sq
        self.written = None
        self._reach(used, fresh=True)
        return spare

    def _commit_window(self, grad: torch.Tensor, grad_sq: float | None, window: tuple[int, int],
                       used: frozenset[int]) -> torch.Tensor:
        start, stop = window
        if not self.grad_valid:  # the rows outside the window hold no gradient: zero them, once
            if self.grad is None:  # a cleared host bucket: a whole buffer from the pool
                self.grad = self.grad_pool.take(self.optim)
            self.grad[:start].zero_()
            self.grad[stop:].zero_()
            self.grad[start:stop].copy_(grad)
            self.grad_valid = True
            self.grad_sq, self.written = grad_sq, [window]
            self._reach(used, fresh=True)
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
        self._reach(used)
        return grad

    def clear(self) -> None:
        """Forget the gradients (`zero_grad(set_to_none=True)`): `.grad` becomes None, the next commit overwrites; a
        host bucket gives its buffer back to the pool ([Note: no spare gradient buffer])."""
        self.grad_valid = False
        self.grad_sq = None
        self.grad_slots = set()
        self._detach_grads()
        if self.tier.gives_back_cleared_grads and self.grad is not None:
            buffer, self.grad = self.grad, None
            self.tier.return_spare(self, buffer)

    def zero(self) -> None:
        """Zero held gradients in place (`zero_grad(set_to_none=False)`): a parameter that had a gradient keeps a
        zero one, one that had none still has none, as torch's optimizers leave them."""
        self._check_version()
        if self.grad_valid:
            self.grad.zero_()
            self.settle()
            self._known(0.0, [])

    def scale(self, ratio: float) -> None:
        self._check_version()
        self.grad.mul_(ratio)
        self.settle()
        self.record_scale(ratio)

    def record_scale(self, ratio: float) -> None:
        """The optimizer's kernel multiplied the gradients by `ratio` as it read them ([Note: clip in the kernel])."""
        scaled = None if self.grad_sq is None else self.grad_sq * ratio * ratio
        # an infinite norm times a 0 coefficient is not the norm of what the gradients became: measure it again
        self._known(scaled if scaled is not None and math.isfinite(scaled) else None, self.written)

    def squared_norm(self) -> float:
        """The squared L2 norm of the held gradients: the device's measurement when there is one, else a host
        pass over the buffer (0 without gradients)."""
        self._check_version()
        if not self.grad_valid:
            return 0.0
        if self.grad_sq is None:
            self._known(float(torch.linalg.vector_norm(self.grad)) ** 2, self.written)
        return self.grad_sq

    def add_pending(self, grad: torch.Tensor, first: bool, window: tuple[int, int] | None = None,
                    used: frozenset[int] | None = None) -> bool:
        """Hold a deferred pass's gradients apart from `grad` until its scale is known; `first` starts the pass's
        sum, overwriting what an earlier pass left ([Note: deferred gradient commit]); `window`: the elements the
        download covers ([Note: row windows]); `used`: the slots it reached, None for all. True when the download
        buffer itself became the pending buffer (the caller keeps it out of the pool until `commit_pending` or
        `drop_pending` gives it back)."""
        start, stop = window or (0, self.optim.numel())
        used = self.all_slots if used is None else used
        if not first:
            self.pending[start:stop].add_(grad)
            self.settle()
            self.pending_slots |= used
            return False
        self.pending_slots = set(used)
        if (start, stop) == (0, self.optim.numel()) and self.pending is None:
            self.pending = grad  # the download's own buffer: no copy, and none kept between passes
            return True
        if self.pending is None:
            self.pending = torch.empty_like(self.optim)  # the gradient's size, dtype and device
        self.pending[:start].zero_()
        self.pending[stop:].zero_()
        self.pending[start:stop].copy_(grad)
        self.settle()
        return False

    def commit_pending(self, ratio: float) -> None:
        self.grad.add_(self.pending, alpha=ratio)
        self.settle()
        self.grad_sq = None
        self.written = None
        self._reach(frozenset(self.pending_slots))
        self.drop_pending()

    def drop_pending(self) -> None:
        """The pending gradients are added or dropped: their buffer goes back to where downloads come from."""
        buffer, self.pending = self.pending, None
        if buffer is not None:
            self.tier.return_spare(self, buffer)

    def add_scaled(self, grad: torch.Tensor, ratio: float, used: frozenset[int] | None = None) -> None:
        """Add a deferred pass's whole-bucket gradients times `ratio`, its scale known already: `commit_pending`'s
        operation without holding them apart ([Note: deferred gradient commit]). Into a bucket that holds
        gradients."""
        self._check_version()
        self.grad.add_(grad, alpha=ratio)
        self.settle()
        self.grad_sq = None
        self.written = None
        self._reach(self.all_slots if used is None else used)

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
        """Each slot's `.grad`: its view of `grad` where it holds a gradient, else None."""
        assert self.grad is not None
        views = self._grad_views()
        self._set_grads([views[i] if i in self.grad_slots else None for i in range(len(self.slots))])

    def _detach_grads(self) -> None:
        self._set_grads([None] * len(self.slots))

    def _set_grads(self, grads: list[torch.Tensor | None]) -> None:
        """The twins' `.grad` become `grads`, and so do the optimizer copies' where the user has not set one since
        the bucket last did: a change of the user's not yet taken in stays for the next `user_grad_changes`
        ([Note: parameters without a gradient])."""
        with self.grads_lock:
            before = self.attached or [None] * len(self.slots)
            for slot, was, grad in zip(self.slots, before, grads):
                if slot.optim.grad is was:
                    slot.optim.grad = grad
                slot.twin.grad = grad
            self.attached = grads if any(g is not None for g in grads) else []

    def _known(self, grad_sq: float | None, written: list[tuple[int, int]] | None) -> None:
        """`grad_sq` and `written` are true of `grad` as it is now."""
        self.grad_sq, self.written = grad_sq, written
        self.grad_version = self.grad._version

    def _reach(self, used: frozenset[int], fresh: bool = False) -> None:
        """[Note: parameters without a gradient]
        A parameter that no loss reaches has `.grad` None in plain torch, and torch's optimizers skip it: no
        weight decay, no momentum, no step count. A bucket has one gradient buffer for all its parameters, so the
        backward's unreached ones would read as zero gradients and be stepped. Each task's backward therefore says
        which slots it reached (`TaskParams.used_slots`: the `.grad` preset on each parameter use is a tensor with
        a version counter of its own, which autograd's in-place accumulation bumps; reading it costs a tenth of a
        microsecond, where a hook per parameter cost three), and only those slots get their view of the buffer as
        `.grad`: a slot's `.grad` is None until some commit since the last `zero_grad(set_to_none=True)` reached
        it. The unreached slots' elements stay zero, so the norms are unchanged. Under data parallelism the ranks
        agree which slots some rank reached ([Note: parameters no rank reaches]).
        The user's own changes are taken where plain torch would see them, in program order: each call of the
        caller's (a pass, `step()`, `zero_grad()`, `clip_grad_norm_`) first compares every slot's `.grad` with what
        the bucket gave it (`user_grad_changes`, under `grads_lock`, which the commit threads' attaching holds
        too) and applies what changed in a gradient turn reserved then (`apply_user_grads`): after the step or
        backward queued before, before anything queued after. `p.grad = None` on an optimizer copy forgets that
        gradient (zeroed, then None; the whole buffer goes back once no slot holds one), `p.grad = t` replaces it
        with `t`'s values. A change made while a backward still runs races it, as reading `p.grad` does: call
        `synchronize()` first."""
        if fresh or not used <= self.grad_slots:
            self.grad_slots = set(used) if fresh else self.grad_slots | used
            self._attach_grads()
        self.grad_version = self.grad._version  # this turn's own write

    def reached_slots(self) -> frozenset[int]:
        """The slots that hold a gradient (their `.grad` set), read in a gradient turn of this bucket's."""
        return frozenset(self.grad_slots) if self.grad_valid else frozenset()

    def user_grad_changes(self) -> dict[int, torch.Tensor | None]:
        """What the user set as the optimizer copies' `.grad` since this bucket last set them (slot index -> the
        tensor, or None), taken as seen: on the caller's thread, in program order, for `apply_user_grads` in a
        gradient turn reserved now ([Note: parameters without a gradient]). (torch refuses a `.grad` of another
        shape, dtype or device when it is set.)"""
        with self.grads_lock:
            attached = self.attached or [None] * len(self.slots)
            changes = {i: slot.optim.grad for i, (slot, grad) in enumerate(zip(self.slots, attached))
                       if slot.optim.grad is not grad}
            if changes:
                self.attached = [changes.get(i, grad) for i, grad in enumerate(attached)]
        return changes

    def apply_user_grads(self, changes: dict[int, torch.Tensor | None]) -> None:
        """`user_grad_changes`' result, in this bucket's gradient turn: a slot set to None loses its gradient
        (zeroed, `.grad` None, and the whole buffer given back once no slot holds one), a slot given a tensor holds
        that tensor's values under the bucket's own view."""
        if not self.grad_valid:
            if all(value is None for value in changes.values()):
                self._detach_grads()  # nothing held: every `.grad` None, as the user's Nones say
                return
            if self.grad is None:
                self.grad = self.grad_pool.take(self.optim)
            self.grad.zero_()
            self.grad_valid, self.grad_slots = True, set()
        views = self.views(self.grad)
        with torch.no_grad():
            for i, value in changes.items():
                if value is None:
                    views[i].zero_()
                    self.grad_slots.discard(i)
                else:
                    views[i].copy_(value)
                    self.grad_slots.add(i)
        self.settle()
        if not self.grad_slots:
            self.clear()
            return
        self._attach_grads()
        self._known(None, None)

    def _check_version(self) -> None:
        """A write into `grad` by anyone but this bucket's turns makes its known norm unknown."""
        if self.grad_valid and self.grad_version != self.grad._version:
            self.grad_sq, self.written = None, None
