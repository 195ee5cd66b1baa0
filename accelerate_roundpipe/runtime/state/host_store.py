"""Host store: every parameter, its optimizer copy and its gradient, in flat per-layer buffers on the CPU.

A *bucket* is one flat buffer of parameters that are always uploaded together: the parameters used by exactly one
layer (per dtype and trainability), or a parameter shared by several layers (tied weights), stored once. Each
bucket holds
- `compute`: the compute copy (param dtype, pinned when a GPU is used and its uploads cross PCIe:
  [Note: compute copies locked where they cross]); the user's module parameters are re-pointed to views of it, so
  `engine.module` always shows the compute copy;
- `optim`: the optimizer copy (optimizer dtype) whose views are the `nn.Parameter`s handed to the optimizer;
- `grad`: the accumulated gradients (optimizer dtype), attached as `.grad` of the optimizer copies; None while a
  host bucket holds none ([Note: no spare gradient buffer]). A commit into an empty bucket swaps the downloaded
  buffer in ([Note: gradient swap]): read `bucket.grad` afresh, never keep it.
Frozen (requires_grad=False) parameters get a compute copy only: no optimizer state, no gradient traffic.

[Note: row windows]
A layer may read only some rows of a parameter: a vocabulary shard reads rows [start, stop) of the lm_head weight
([Note: vocabulary shards]). It says so with `parameter_rows()` (the parameter's name inside the layer -> its row
range). Its `Binding` then carries that *window* of the bucket (elements, contiguous: rows of a row-major tensor),
and a task uploads, binds and sends back gradients for only the union of its layers' windows of each bucket
(`HostStore.window`), not the whole bucket. The buckets, the optimizer and its parameters stay whole: one parameter,
one bucket, one optimizer step, whatever the layers that read it. A windowed commit adds into its rows of the
bucket's gradient (`Bucket.commit`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from ..devices.pinned import HostMemory
from . import host_budget, saved_input_buffers
from .bucket import Bucket, ParamSlot
from .grad_buffers import GradBufferPool
from .saved_input_buffers import SavedInputBuffers
from .weight_versions import StepCount

__all__ = ["Bucket", "HostStore", "ParamSlot", "StepCount"]

ALIGN = 16  # elements; keeps every parameter view aligned for vectorised kernels
PROGRESS_MIN_PARAMS = 200_000_000  # models this large show a progress bar while the host store is built


def _align(n: int, multiple: int = ALIGN) -> int:
    return (n + multiple - 1) // multiple * multiple


def uninitialized(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """[Note: bucket flats filled once]
    A bucket's compute copy and optimizer copy are flat buffers the parameters are copied into, each at an
    `ALIGN`-ed offset, the bucket padded to `pad_multiple`. They were made with `torch.zeros` and then copied into:
    two passes over every byte, where the copy alone writes all but the alignment gaps (a model of 8B zeroed 48 GB
    of compute and optimizer copies before copying into them). On this repository's 2-core box, idle, wrapping the
    168M convergence preset with its optimizer took 0.26-0.30 s before and 0.20-0.24 s after (three runs each;
    not measured on a GPU's host yet). The buffers are now made uninitialized
    and, after the copy, only the gaps between parameters and the padding are zeroed (`_gaps`), so every byte is
    written once and the contents are what zeros-then-copy gave (a gap is never a parameter, but whole-flat reads
    see it: uploads, norms, swap files). Tests replace this function to fill new buffers with NaN."""
    return torch.empty(numel, dtype=dtype)


def _gaps(slots, numel: int) -> list[tuple[int, int]]:
    """The [start, end) ranges of a flat of `numel` elements that no slot covers, in order."""
    gaps, at = [], 0
    for slot in sorted(slots, key=lambda s: s.offset):
        if slot.offset > at:
            gaps.append((at, slot.offset))
        at = max(at, slot.offset + slot.numel)
    if at < numel:
        gaps.append((at, numel))
    return gaps


def optimizer_dtype_for(param_dtype: torch.dtype, requested: torch.dtype | None) -> torch.dtype:
    if requested is not None:
        return requested
    return torch.float64 if param_dtype == torch.float64 else torch.float32


def _binding(module_path: str, attr: str, bucket_index: int, slot: ParamSlot, slot_index: int,
             rows: tuple[int, int] | None) -> Binding:
    """The binding of one parameter use; `rows`: the row range the layer reads, if not all ([Note: row windows])."""
    if rows is None:
        return Binding(module_path, attr, bucket_index, slot_index)
    start, stop = rows
    num_rows = slot.shape[0] if len(slot.shape) else 0
    if not 0 <= start < stop <= num_rows:
        raise ValueError(f"parameter_rows() of a layer gives rows {start}..{stop} of {slot.name}, which has "
                         f"{num_rows} rows.")
    row = slot.numel // num_rows
    window = (slot.offset + start * row, slot.offset + stop * row)
    return Binding(module_path, attr, bucket_index, slot_index, window, torch.Size((stop - start, *slot.shape[1:])))


@dataclass(frozen=True)
class Binding:
    """Where one parameter use inside a layer gets its tensor from."""

    module_path: str  # submodule path inside the layer ("" = the layer itself)
    attr: str
    bucket_index: int
    slot_index: int
    # The elements [start, stop) of the bucket the layer reads and the shape it sees them in, when it reads only
    # some rows of the parameter ([Note: row windows]); None: the whole parameter.
    window: tuple[int, int] | None = None
    shape: torch.Size | None = None


class HostStore:
    def __init__(self, layers: list[nn.Module], param_dtype: torch.dtype | None,
                 optimizer_dtype: torch.dtype | None, pin_memory: bool, names: dict[int, str],
                 pin_optimizer_copies: bool = False, pad_multiple: int = 1,
                 defer_compute_locks: bool = False) -> None:
        self.layers = layers
        # Trainable buckets are padded to a multiple of this: equal per-rank ranges ([Note: data parallel]).
        self.pad_multiple = pad_multiple
        self.released = False  # `release()` ran: the engine closed ([Note: memory freed at close])
        self.pin_memory = pin_memory
        # Exact steps upload the optimizer copies themselves ([Note: exact step without write-back]); locked once
        # the placement has kept them on the host ([Note: optimizer copies locked after the placement]).
        self.pin_optimizer_copies = pin_memory and pin_optimizer_copies
        self._locked_optim: set[int] = set()  # bucket indices whose optimizer copy is page-locked
        # Trainable buckets' compute copies locked once their tier is known, not at the build
        # ([Note: compute copies locked where they cross]); frozen ones are always uploaded: locked at the build.
        self.defer_compute_locks = pin_memory and defer_compute_locks
        self._locked_compute: set[int] = set()  # bucket indices whose compute copy is page-locked
        self._compute_locks_settled = not self.defer_compute_locks
        self.memory = HostMemory(pin_memory)  # exact-size page-locked buffers ([Note: exact-size pinned memory])
        self.grad_pool = GradBufferPool(self.memory)  # where gradient downloads land ([Note: gradient swap])
        # Where saved layer inputs land, None for torch's page-locked cache ([Note: saved inputs in pooled blocks])
        self.saved_input_buffers = SavedInputBuffers(self.memory) if saved_input_buffers.POOLED else None
        users: dict[int, list[int]] = {}  # id(param) -> layers using it
        params: dict[int, nn.Parameter] = {}
        for layer_index, layer in enumerate(layers):
            for _, p in layer.named_parameters(remove_duplicate=False):
                params[id(p)] = p
                if layer_index not in users.setdefault(id(p), []):
                    users[id(p)].append(layer_index)

        # One bucket per (set of layers using it, trainable, dtype): tied weights get a bucket of their own.
        groups: dict[tuple, list[nn.Parameter]] = {}
        for pid, p in params.items():
            groups.setdefault((tuple(users[pid]), p.requires_grad, param_dtype or p.dtype), []).append(p)

        entries = [(p.numel(), param_dtype or p.dtype, p.requires_grad) for p in params.values()]
        # What the store will hold with AdamW state (the engine's start summary shows it too).
        self.estimated_bytes = host_budget.store_bytes(entries, lambda d: optimizer_dtype_for(d, optimizer_dtype))
        freed = sum(p.numel() * p.element_size() for p in params.values())
        host_budget.warn_if_short(self.estimated_bytes, freed=freed)

        self.buckets: list[Bucket] = []
        self.bucket_of: dict[int, tuple[int, int]] = {}  # id(param) -> (bucket, slot)
        order = sorted(groups, key=lambda k: (min(k[0]), k[0], not k[1], str(k[2])))
        total = sum(p.numel() for p in params.values())
        # Pinning a multi-GB model takes a while: show it (tqdm hides itself when not on a terminal-like stream).
        progress = tqdm(total=total, unit="param", unit_scale=True, desc="RoundPipe: host store",
                        disable=total < PROGRESS_MIN_PARAMS, leave=False)
        for layer_ids, trainable, dtype in order:
            members = groups[(layer_ids, trainable, dtype)]
            self.buckets.append(self._make_bucket(len(self.buckets), layer_ids, trainable, dtype, optimizer_dtype,
                                                  members, names))
            progress.update(sum(p.numel() for p in members))
        progress.close()

        self.layer_bindings: list[list[Binding]] = []
        self.layer_buckets: list[list[int]] = []
        self._windows: dict[tuple[int, int, int], tuple[int, int]] = {}  # (span, bucket) -> window
        for layer in layers:
            rows = layer.parameter_rows() if hasattr(layer, "parameter_rows") else {}
            bindings, used = [], []
            for module_path, module in layer.named_modules(remove_duplicate=False):
                for attr, p in module._parameters.items():
                    if p is None:
                        continue
                    bucket_index, slot_index = self.bucket_of[id(p)]
                    name = f"{module_path}.{attr}" if module_path else attr
                    slot = self.buckets[bucket_index].slots[slot_index]
                    bindings.append(_binding(module_path, attr, bucket_index, slot, slot_index, rows.get(name)))
                    if bucket_index not in used:
                        used.append(bucket_index)
            self.layer_bindings.append(bindings)
            self.layer_buckets.append(sorted(set(used)))

    def _make_bucket(self, index, layer_ids, trainable, dtype, optimizer_dtype, members, names) -> Bucket:
        slots, offset = [], 0
        for p in members:
            slots.append(ParamSlot(names.get(id(p), f"param{id(p)}"), p, offset, p.numel(), p.shape,
                                   model_dtype=p.dtype))
            offset += _align(p.numel())
        numel = _align(max(offset, 1), self.pad_multiple if trainable else 1)
        # [Note: bucket flats filled once]: the parameters are copied in below and only the gaps between them zeroed
        if trainable and self.defer_compute_locks:
            compute = uninitialized(numel, dtype)  # `lock_crossing_compute_copies` locks it where it crosses
        else:
            compute = uninitialized(numel, dtype)
            self.memory.lock(compute)  # page-locked in place when the store pins ([Note: exact-size pinned memory])
            if self.pin_memory:
                self._locked_compute.add(index)
        optim = None
        if trainable:
            odtype = optimizer_dtype_for(dtype, optimizer_dtype)
            # Uploaded by exact steps, once the placement has kept the bucket on the host (`lock_optimizer_copy`).
            optim = uninitialized(compute.numel(), dtype=odtype)
        # No gradient buffer yet: the first download's becomes it ([Note: no spare gradient buffer]).
        bucket = Bucket(index, tuple(layer_ids), trainable, compute, optim, None, slots, grad_pool=self.grad_pool)
        with torch.no_grad():
            for slot_index, slot in enumerate(slots):
                original = slot.param.detach()
                if optim is not None:
                    # From the original values, so a float32 model keeps full precision in its optimizer copy.
                    optim[slot.offset:slot.offset + slot.numel].copy_(original.reshape(-1))
                    slot.optim = nn.Parameter(optim[slot.offset:slot.offset + slot.numel].view(slot.shape))
                    slot.twin = nn.Parameter(slot.optim.data)  # [Note: parameters without a gradient]
                view = compute[slot.offset:slot.offset + slot.numel].view(slot.shape)
                view.copy_(original)
                slot.param.data = view
                self.bucket_of[id(slot.param)] = (index, slot_index)
            for start, end in _gaps(slots, numel):
                compute[start:end].zero_()
                if optim is not None:
                    optim[start:end].zero_()
        if optim is not None:
            bucket.versions.loaded_into_both()
        return bucket

    def lock_optimizer_copy(self, bucket: Bucket) -> None:
        """Page-lock `bucket`'s optimizer copy, which stays in host memory and which exact steps upload
        ([Note: optimizer copies locked after the placement]); once per bucket, only when they are pinned.

        [Note: optimizer copies locked after the placement]
        The optimizer copies are made in ordinary memory and locked only when the optimizer's placement keeps
        them on the host. Locked at the build, the copies of buckets the placement then moves to their device were
        locked for nothing and unlocked again (after a device synchronize): on the 168M convergence preset, whose
        buckets all go to the GPU, 672 MB of float32 copies, most of the 0.56 s of `cudaHostRegister` at the
        engine's start (docs/benchmarks.md, evaluation and start-up)."""
        if self.pin_optimizer_copies and bucket.optim is not None and bucket.index not in self._locked_optim:
            self.memory.lock(bucket.optim)
            self._locked_optim.add(bucket.index)

    def lock_crossing_compute_copies(self) -> None:
        """Page-lock the compute copies of the trainable buckets whose tier uploads them over PCIe, once each
        ([Note: compute copies locked where they cross]). Called after the optimizer's placement, and before the
        first pass when no optimizer was placed by then (every bucket is the host's then).

        [Note: compute copies locked where they cross]
        A bucket's compute copy is uploaded by every task that reads its host version: always for a frozen bucket
        and for one whose optimizer state is on the host or disk, but for a bucket with a home device
        ([Note: optimizer placement]) only until its first step (readers then read the stepped optimizer copy on
        the device) and after a failure's write-back. On the 168M convergence preset every bucket goes to the GPU,
        and locking their compute copies at the build was most of what was left of the start's `cudaHostRegister`
        time. So with `defer_compute_locks` (the engine's setting) the trainable compute copies are made in ordinary
        memory and locked here once the tiers are known; a device bucket's stays pageable. What touches it then:
        - the uploads of the passes before its first step (`Device.upload_params_into`): a non_blocking copy from
          pageable memory is staged by CUDA before the call returns, so the host buffer is free again at once (the
          stash of a look was always uploaded so); such uploads are not timed for the measured plan
          (`uploads_pageable`), whose rate is that of page-locked memory;
        - a look (`show_current`), a checkpoint's reads and loads, a failure's write-back: blocking copies
          (`copy_with_cast`), on threads that wait for them.
        No asynchronous download (`_copy_to_host`, only into gradient buffers and norms) ever targets it."""
        self._compute_locks_settled = True
        if not self.defer_compute_locks:
            return
        for bucket in self.trainable_buckets:
            if bucket.tier.crosses_pcie and bucket.index not in self._locked_compute:
                self.memory.lock(bucket.compute)
                self._locked_compute.add(bucket.index)

    def lock_compute_copies_before_first_pass(self) -> None:
        """Before every pass: the first one locks what crosses if no placement did; later ones return at once
        ([Note: compute copies locked where they cross])."""
        if not self._compute_locks_settled:
            self.lock_crossing_compute_copies()

    def uploads_pageable(self, bucket_index: int, host: torch.Tensor) -> bool:
        """Whether an upload from `host` (bucket `bucket_index`'s buffer a reader reads) runs from memory the store
        left pageable although it pins: a deferred compute copy of a device bucket
        ([Note: compute copies locked where they cross])."""
        compute = self.buckets[bucket_index].compute
        return (self.defer_compute_locks and bucket_index not in self._locked_compute and host.device.type == "cpu"
                and host.untyped_storage().data_ptr() == compute.untyped_storage().data_ptr())

    @property
    def locked_copies(self) -> dict[int, tuple[str, ...]]:
        """Which host copies of each bucket are page-locked (bucket index -> "compute", "optim"), plain data that
        tests read ([Note: compute copies locked where they cross]). Empty when nothing is pinned."""
        out = {}
        for bucket in self.buckets:
            names = tuple(name for name, locked in (("compute", bucket.index in self._locked_compute),
                                                    ("optim", bucket.index in self._locked_optim)) if locked)
            if names:
                out[bucket.index] = names
        return out

    def window(self, layers: range, bucket_index: int) -> tuple[int, int]:
        """The elements [start, stop) of bucket `bucket_index` that the layers `layers` read: the whole bucket unless
        every use is a row window, then the smallest range covering them ([Note: row windows]). Asked for every
        bucket of every task, so kept per span (the bindings never change)."""
        key = (layers.start, layers.stop, bucket_index)
        window = self._windows.get(key)
        if window is None:
            uses = [b.window for layer in layers for b in self.layer_bindings[layer] if b.bucket_index == bucket_index]
            if not uses or any(w is None for w in uses):
                window = (0, self.buckets[bucket_index].compute.numel())
            else:
                window = (min(w[0] for w in uses), max(w[1] for w in uses))
            self._windows[key] = window
        return window

    def window_bytes(self, layers: range, trainable_only: bool = False) -> int:
        """Bytes of the compute copies the layers `layers` read, their row windows only ([Note: row windows])."""
        total = 0
        for bucket_index in self.buckets_of_layers(layers):
            bucket = self.buckets[bucket_index]
            if bucket.trainable or not trainable_only:
                start, stop = self.window(layers, bucket_index)
                total += (stop - start) * bucket.compute.element_size()
        return total

    def buckets_of_layers(self, layers: range) -> list[int]:
        used: set[int] = set()
        for layer in layers:
            used.update(self.layer_buckets[layer])
        return sorted(used)

    def bytes_still_to_allocate(self, host_state_bytes: int | None) -> int:
        """What the store will still allocate in host memory: the gradient buffers of the buckets that hold none
        yet and the optimizer states, assumed not allocated yet (the first pass comes before the first step; a
        resumed run's loaded states are counted again, which errs on the safe side); a disk bucket's gradient is
        in memory too. `host_state_bytes`: the placement's count of the host's optimizer copies, gradients and
        states (disk and device buckets left out), None before an optimizer is wrapped: every trainable bucket's,
        with AdamW's two states."""
        def nbytes(flat: torch.Tensor | None) -> int:
            return 0 if flat is None else flat.numel() * flat.element_size()

        trainable = self.trainable_buckets
        if host_state_bytes is None:
            return sum(nbytes(b.optim) * (1 + host_budget.OPTIMIZER_STATES) - nbytes(b.grad) for b in trainable)
        # Asked of the tiers ([Note: state tiers]): a device's gradients do not cross to the host, a disk's do
        on_host = [b for b in trainable if b.tier.crosses_pcie and b.tier.optim_resident]
        on_disk = [b for b in trainable if b.tier.crosses_pcie and not b.tier.optim_resident]
        in_memory = sum(nbytes(b.optim) + nbytes(b.grad) for b in on_host)
        disk_grads = sum(b.optim.numel() * b.optim.element_size() for b in on_disk if b.grad is None)
        return max(0, host_state_bytes - in_memory) + disk_grads

    def release(self) -> None:
        """[Note: memory freed at close]
        The engine's objects refer to one another (workers, their residencies and commit queues, the store, the
        optimizer and its layout): once dropped they are freed by Python's cycle collector, not when the last
        reference goes, and a collection of the oldest generation can be long in coming. So the optimizer state, the
        optimizer copies and the gradients (about 20 of the 22 host bytes of a trainable parameter, and a device's
        share where state is placed on it) stayed allocated after `close()` (or after an engine was dropped without
        it) until the collector ran, twice: a notebook's or a sweep's next engine could find the host full. At
        `close()`, and when a dropped engine's finalizer has stopped its threads, each owner lets go of its buffers
        (the buckets here, the optimizer's layout, each worker's reusable weight buffers), so their memory goes
        back at once whatever still refers to the engine. The compute copies stay: the user's module views them.
        The optimizer copies' parameters, which the user's optimizer holds (it was built over
        `engine.parameters()`), keep their shape and dtype over one element of host memory, as a disk bucket's do
        between its steps, and lose their `.grad`: held, they would keep the copies (on the GPU where the state
        was placed there: the first GPU run of the test found 6 of 101 MiB left so). A new engine collects
        earlier engines that are only garbage before it allocates (`engine_parts.collect_earlier_engines`)."""
        for bucket in self.buckets:
            bucket.release()
        self.grad_pool.release()
        if self.saved_input_buffers is not None:
            self.saved_input_buffers.release()
        self.memory.release()
        self.released = True

    def weights_stay_on(self, device: torch.device) -> bool:
        """Whether every bucket's weights are read from memory on `device` by its tasks: each bucket trainable and
        at home there ([Note: one-stage evaluation])."""
        return all(bucket.tier.weights_stay_on(device) for bucket in self.buckets)

    @property
    def trainable_buckets(self) -> list[Bucket]:
        return [b for b in self.buckets if b.trainable]

    @functools.cached_property
    def trainable_in_backward_order(self) -> list[Bucket]:
        """Top layers first: the order a backward makes the buckets' gradients final. Host work that takes
        gradient turns must be queued in this order on its (serial) thread: a job for a bottom bucket queued first
        would hold every later job until the backward's very end. (The buckets never change: computed once.)"""
        return sorted(self.trainable_buckets, key=lambda b: -min(b.layers))
