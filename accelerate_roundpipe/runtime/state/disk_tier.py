"""The disk tier: the optimizer copies and optimizer states of the buckets past the host memory budget, in swap files
under `offload_dir`, in memory only in a staging slot around their step.

[Note: disk tier]
Which buckets (`plan_disk`): when the store's host bytes (every compute copy; for each trainable bucket on the host
its optimizer copy, gradient and optimizer states) exceed `host_memory_budget`, buckets go to disk from the top layers
down until the rest and the staging fit, skipping buckets much larger than the others where that needs fewer bytes on
disk ([Note: staging slots sized by the plan]). The top layers are stepped first in the backward, so their reads have
the whole backward's tail to run ahead, and the next forward needs them last; a tied embedding (lowest layer 0) goes
last. What stays in host memory of a disk bucket: its compute copy, which its readers read (`optim_resident` is
False), its gradient buffers (the host pool's, as any host bucket's) and the optimizer's scalar state (AdamW's
`step`). Its file holds its image: the optimizer copy, then each state tensor the optimizer keeps per parameter
(`state_names`: AdamW's `exp_avg`, `exp_avg_sq`, `max_exp_avg_sq` with amsgrad; SGD's `momentum_buffer`), each 4 KiB
aligned, the bucket's element offsets inside each ([Note: swap file per bucket]).

One step, in the order of the protocol of `DiskStaging` ([Note: disk staging protocol]):
1. `will_step` (at `step()`, caller's thread): the tier's buckets in the order the exact step takes them (backward
   order, bottom-up after a clip) are scheduled; up to `SLOTS` reads start at once into the page-locked slots.
2. `before_step` (optimizer thread, the bucket's gradient turn and write turn): `acquire` waits for the read; the
   bucket's optimizer copy (`Bucket.point_optim`) and the optimizer's state entries of its parameters are pointed at
   the slot's views. The exact step's job takes this tier's buckets in that same order (`ordered_steps`).
3. The optimizer steps the slot in place (a first step makes the state in memory of the optimizer's own).
4. The optimizer writes the stepped copy into the compute copy (`write_back`, in the write turn: the next upload
   reads it) after an exact step; after a lagged one it keeps it apart, cast to the compute dtype
   (`hold_newest`), for the write-back held until the next `step()` as a host bucket's is ([Note: one-step lag]).
5. `after_step`: the state entries are taken out of the optimizer's state (a first step's copied into the slot),
   the bucket points at a stand-in again (zero-stride, no memory; a write into it raises), and `release(dirty)`
   writes the slot back to the file, after which the slot takes the next read.
Between steps the optimizer's state of a disk bucket's parameter holds only what is not the parameter's size
(`step`); which entries the file holds is `_stored`. The tier's own fields change on the optimizer thread in the
bucket's turns, or on the caller's while nothing runs (a load, a look): the same turns that order the bucket's
gradients.

Checkpoints stay the optimizer's format: `showing_state` puts the file's state entries (read-only-mapped views of
the files: nothing is read into memory until the checkpoint writer reads it) into the state for `state_dict()`,
`take_state` moves a loaded state into the files, `resident` and `optim_values` serve the loads and reads of
optimizer copies. So a checkpoint resumes under any mix of tiers. The swap files are never a checkpoint: they are
removed at `close()`, and a killed run's at the next start ([Note: swap folder ownership]).

With the lagged step (`async_optimizer`) a disk bucket lags as a host bucket does: its jobs take the buckets in
backward order, the order announced; between its step and the held write-back it holds one compute-sized buffer
(2 bytes a parameter in bfloat16), which the budget does not count.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..devices.pinned import HostMemory
from ..disk import BucketLayout, DiskBandwidth, DiskStaging, MappedFlat, TensorSpec, open_swap, probe_bandwidth
from .tiers import Bucket, StateTier, stand_in

OPTIM = "optim"  # the optimizer copy's name in a bucket's layout
SLOTS = 3  # staging slots: one stepped, one written back, one read ahead
PIECE_BYTES = 48 * 2**20  # of a bucket's optimizer copy a swap file's piece holds, about ([Note: swap files in pieces])
MAX_PIECES = 8
PROBE_MIN_BYTES = 4 * 2**20
PROBE_MAX_BYTES = 256 * 2**20


def state_names(optimizer: torch.optim.Optimizer) -> tuple[str, ...] | None:
    """The optimizer's state entries of a parameter's size, which the disk tier keeps in the files; None for a class
    whose state it does not know."""
    groups = optimizer.param_groups
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if any(g.get("amsgrad") for g in groups) else ())
    if isinstance(optimizer, torch.optim.SGD):
        return ("momentum_buffer",) if any(g.get("momentum") for g in groups) else ()
    return None


def host_state_bytes(bucket: Bucket, copies: int) -> int:
    """A trainable host bucket's bytes besides its compute copy: optimizer copy, gradient, `copies` states."""
    return bucket.optim.numel() * bucket.optim.element_size() * (2 + copies)


def layout_of(bucket: Bucket, names: tuple[str, ...]) -> BucketLayout:
    numel, dtype = bucket.optim.numel(), bucket.optim.dtype
    return BucketLayout.of([TensorSpec(OPTIM, numel, dtype), *(TensorSpec(name, numel, dtype) for name in names)],
                           piece_splits(bucket))


def piece_splits(bucket: Bucket, piece_bytes: int | None = None, max_pieces: int | None = None) -> tuple[int, ...]:
    """Where the bucket's swap file is cut into pieces ([Note: swap files in pieces]): at the parameter boundaries
    nearest to equal shares of about `PIECE_BYTES` of its optimizer copy, at most `MAX_PIECES`; none for a small
    bucket or one parameter. Every parameter's values then lie in one piece."""
    piece_bytes = PIECE_BYTES if piece_bytes is None else piece_bytes
    max_pieces = MAX_PIECES if max_pieces is None else max_pieces
    numel = bucket.optim.numel()
    count = min(max_pieces, numel * bucket.optim.element_size() // max(1, piece_bytes))
    if count < 2:
        return ()
    bounds = [b for b in sorted({slot.offset for slot in bucket.slots} - {0}) if b < numel]
    if not bounds:
        return ()
    chosen = {min(bounds, key=lambda b, target=numel * i // count: abs(b - target)) for i in range(1, count)}
    return tuple(sorted(chosen))


@dataclass(frozen=True)
class DiskPlan:
    """Which buckets go to disk under a host budget, and the host bytes that leaves (plain data)."""

    buckets: tuple[int, ...]  # top layers first
    budget_bytes: int
    host_bytes_before: int  # the store with every trainable bucket of the host in memory
    host_bytes: int  # with these on disk, staging included
    file_bytes: int  # their swap files
    staging_bytes: int

    @property
    def fits(self) -> bool:
        return self.host_bytes <= self.budget_bytes


def plan_disk(host_buckets: list[Bucket], fixed_bytes: int, budget_bytes: int, names: tuple[str, ...],
              slots: int = SLOTS) -> DiskPlan:
    """The buckets of `host_buckets` (trainable, on the host) that go to disk, top layers first, until the store's
    host bytes (`fixed_bytes`: the compute copies and what else stays) fit `budget_bytes` ([Note: disk tier]).

    [Note: staging slots sized by the plan]
    The staging slots are as large as the largest disk bucket's file, `slots` of them, in host memory. One bucket
    much larger than the others (an untied LM head: 525M parameters on Llama-3.1-8B, a 6.3 GB file against 2.6 GB
    for a decoder layer) made the slots cost three times its file, more than moving it saved: the 8B run's host
    peak went 22.5 GiB past its budget. So a plan is made under each size cap (the distinct file sizes, largest
    first: every bucket a candidate, then all but the largest, ...), top-down among the buckets under it; of the
    plans that fit, the one with the fewest file bytes (the disk traffic a step pays) wins, ties to the larger cap;
    when none fits, the one that leaves the fewest host bytes."""
    sizes = {b.index: layout_of(b, names).nbytes for b in host_buckets}
    caps = sorted(set(sizes.values()), reverse=True) or [0]
    plans = [_plan_under(host_buckets, sizes, cap, fixed_bytes, budget_bytes, len(names), slots) for cap in caps]
    fitting = [plan for plan in plans if plan.fits]
    if fitting:
        return min(fitting, key=lambda plan: plan.file_bytes)  # the first of equals: the larger cap
    return min(plans, key=lambda plan: plan.host_bytes)


def _plan_under(host_buckets: list[Bucket], sizes: dict[int, int], cap: int, fixed_bytes: int, budget_bytes: int,
                copies: int, slots: int) -> DiskPlan:
    """`plan_disk` among the buckets whose file is at most `cap` bytes."""
    host = fixed_bytes + sum(host_state_bytes(b, copies) for b in host_buckets)
    before, chosen, largest, files = host, [], 0, 0
    for bucket in sorted(host_buckets, key=lambda b: (-min(b.layers), -b.index)):
        staging = min(slots, len(chosen)) * largest
        if host + staging <= budget_bytes:
            break
        nbytes = sizes[bucket.index]
        if nbytes > cap:
            continue
        host -= bucket.optim.numel() * bucket.optim.element_size() * (1 + copies)  # the gradient stays
        chosen.append(bucket.index)
        largest, files = max(largest, nbytes), files + nbytes
    staging = min(slots, len(chosen)) * largest
    return DiskPlan(tuple(chosen), budget_bytes, before, host + staging, files, staging)


def probe_size(file_bytes: int) -> int:
    return int(min(PROBE_MAX_BYTES, max(PROBE_MIN_BYTES, file_bytes)))


class DiskTier(StateTier):
    """Buckets whose optimizer copy and state live in swap files ([Note: disk tier]). One per engine."""

    stale_compute_after_exact_step = False  # `after_step` writes the compute copy
    optim_resident = False
    ordered_steps = True  # the staging reads in the announced order

    def __init__(self, staging: DiskStaging, names: tuple[str, ...], bandwidth: DiskBandwidth | None) -> None:
        self.staging, self.names, self.bandwidth = staging, names, bandwidth
        self.folder = staging.files.folder.path
        self._state_of: Callable[[], dict] = dict
        self._trace: Any = None
        self._stored: dict[int, tuple[str, ...]] = {}  # id(optimizer copy parameter) -> the entries its file holds
        self._held: dict[int, dict[str, torch.Tensor]] = {}  # bucket index -> its slot's tensors, during its step

    @classmethod
    def open(cls, buckets: list[Bucket], names: tuple[str, ...], offload_dir: str, timeout_s: float,
             memory: HostMemory, slots: int = SLOTS) -> DiskTier:
        """Check `offload_dir`, remove dead runs' leftovers, make this run's swap files for `buckets`, measure the
        disk, and write their optimizer copies there (zero state) ([Note: disk tier]); the buckets are not moved.

        `memory`: the store's `HostMemory`, which allocates the staging slots at their exact size, page-locked with
        a GPU, and unlocks them with the store's buffers at `close()` ([Note: exact-size pinned memory]). Torch's
        page-locked allocator (the staging's own default) rounds them up to a power of two: Llama-3.1-8B's 7.31 GiB
        of slots took 8 GiB, outside what the start summary counted."""
        layouts = {b.index: layout_of(b, names) for b in buckets}
        tier_ref: list[DiskTier] = []
        staging = open_swap(offload_dir, layouts, min(slots, len(buckets)), timeout_s=timeout_s,
                            span=lambda kind, path, start, n: tier_ref[0].io_span(kind, path, start, n),
                            allocate=lambda nbytes: memory.empty(nbytes, torch.uint8))
        try:
            # The probe first: after the images' writes the kernel is still flushing them (tens of GiB through the
            # page cache), and a probe then measured that flush's leftovers (0.38 against 1.35 GB/s on the H100
            # machine, and a start summary's implied step 4 times too long).
            bandwidth = probe_bandwidth(staging.files.folder.path, probe_size(staging.files.nbytes))
            for bucket in buckets:
                image = torch.zeros(layouts[bucket.index].nbytes, dtype=torch.uint8)
                layouts[bucket.index].views(image)[OPTIM].copy_(bucket.optim)
                staging.files[bucket.index].write_range(image, 0, image.numel())
        except BaseException:
            staging.close()
            raise
        tier = cls(staging, names, bandwidth)
        tier_ref.append(tier)
        return tier

    def io_span(self, kind: str, path: str, start: int, nbytes: int):
        """The trace's span of one chunk's read or write, on the disk track of the I/O thread moving it ("disk io0",
        ...: each thread's chunks follow one another, so no two spans of a track overlap)."""
        trace = self._trace
        if trace is None:
            return contextlib.nullcontext()
        thread = threading.current_thread().name.rsplit("_", 1)[-1]
        return trace.span(f"disk io{thread}", f"{kind} {os.path.basename(path)} [{start}, {start + nbytes})")

    def stand_in_of(self, bucket: Bucket) -> torch.Tensor:
        return stand_in(bucket.optim.numel(), bucket.optim.dtype)

    # ------------------------------------------------------------------ the step ([Note: state tiers])

    def attach(self, state_of: Callable[[], dict], trace: Any) -> None:
        self._state_of, self._trace = state_of, trace

    def on_look(self, bucket: Bucket) -> None:
        """`synchronize()`: the compute copy shows the step already; the write-backs still in flight finish, so
        that after it nothing of the step is left running (and the files hold the newest state)."""
        self.staging.flush()

    def will_step(self, buckets: list[Bucket]) -> None:
        self.staging.schedule([b.index for b in buckets])

    def before_step(self, bucket: Bucket) -> None:
        trace = self._trace  # the optimizer thread's wait for the read, on its own track
        with trace.span(self.track, f"wait for the read of bucket{bucket.index}") if trace is not None \
                else contextlib.nullcontext():
            views = self.staging.acquire(bucket.index)
        self._held[bucket.index] = views
        self._bind(bucket, views, self._state_of())

    def after_step(self, bucket: Bucket) -> None:
        # the optimizer wrote the step into the compute copy (exact) or kept it apart (lagged) already
        views = self._held.pop(bucket.index)
        self._take_entries(bucket, views, self._state_of())
        bucket.point_optim(self.stand_in_of(bucket), resident=False)
        self.staging.release(bucket.index, dirty=True)

    # ------------------------------------------------------------------ while nothing runs

    def take_state(self, bucket: Bucket, state: dict) -> None:
        with self._image(bucket, write=True) as views:
            self._take_entries(bucket, views, state)

    @contextlib.contextmanager
    def showing_state(self, bucket: Bucket, state: dict) -> Iterator[None]:
        shown = self._point_entries(bucket, self._mapped(bucket), state)
        try:
            yield
        finally:
            for param, entry, stored in shown:
                for name in stored:
                    entry.pop(name, None)
                if not entry:
                    state.pop(param, None)

    @contextlib.contextmanager
    def resident(self, bucket: Bucket, write: bool = True) -> Iterator[None]:
        with self._image(bucket, write) as views:
            state = self._state_of()
            self._bind(bucket, views, state)
            try:
                yield
            finally:
                self._take_entries(bucket, views, state)
                bucket.point_optim(self.stand_in_of(bucket), resident=False)

    def optim_values(self, bucket: Bucket) -> MappedFlat:
        return self._mapped(bucket)[OPTIM]

    def close(self) -> None:
        self.staging.close()

    # ------------------------------------------------------------------ helpers

    def _bind(self, bucket: Bucket, views: dict[str, torch.Tensor], state: dict) -> None:
        """Point the bucket's optimizer copy and its parameters' stored state entries at `views`."""
        bucket.point_optim(views[OPTIM])
        self._point_entries(bucket, views, state)

    def _point_entries(self, bucket: Bucket, views: dict[str, torch.Tensor], state: dict) -> list[tuple]:
        """Point the state entries the files hold of `bucket`'s parameters at `views`; (parameter, its entry, the
        names pointed) for each parameter that has some."""
        pointed = []
        for slot in bucket.slots:
            stored = self._stored.get(id(slot.optim), ())
            if stored:
                entry = state.setdefault(slot.optim, {})
                for name in stored:
                    entry[name] = _slot_view(views[name], slot)
                pointed.append((slot.optim, entry, stored))
        return pointed

    def _take_entries(self, bucket: Bucket, views: dict[str, torch.Tensor], state: dict) -> None:
        """Take the parameters' state entries of a parameter's size out of `state` into `views` (copied when the
        optimizer made them in memory of its own: a first step, a load) and remember which the file holds."""
        for slot in bucket.slots:
            entry = state.get(slot.optim)
            stored = []
            for name in self.names:
                value = entry.get(name) if entry is not None else None
                if not torch.is_tensor(value) or value.numel() != slot.numel:
                    continue
                view = _slot_view(views[name], slot)
                if value.data_ptr() != view.data_ptr():
                    with torch.no_grad():
                        view.copy_(value)
                del entry[name]
                stored.append(name)
            if stored:
                self._stored[id(slot.optim)] = tuple(stored)
            else:
                self._stored.pop(id(slot.optim), None)
            if entry is not None and not entry:
                state.pop(slot.optim, None)

    @contextlib.contextmanager
    def _image(self, bucket: Bucket, write: bool) -> Iterator[dict[str, torch.Tensor]]:
        """The bucket's file image read into memory of its own (its write-backs done first); with `write`, written
        back whole afterwards, synchronously."""
        self.staging.flush()
        file, layout = self.staging.files[bucket.index], self.staging.files.layouts[bucket.index]
        image = torch.empty(layout.nbytes, dtype=torch.uint8)
        file.read_range(image, 0, layout.nbytes)
        yield layout.views(image)
        if write:
            file.write_range(image, 0, layout.nbytes)

    def _mapped(self, bucket: Bucket) -> dict[str, MappedFlat]:
        """The bucket's file image mapped copy-on-write (read when read; written by nobody), its write-backs done:
        each tensor piece by piece, every parameter's slice a view of one piece."""
        self.staging.flush()
        file = self.staging.files[bucket.index]
        return {spec.name: file.mapped(spec.name) for spec in file.layout.specs}


def _slot_view(flat: torch.Tensor, slot) -> torch.Tensor:
    return flat[slot.offset:slot.offset + slot.numel].view(slot.shape)
