"""Where a trainable bucket's optimizer copy, gradient and optimizer state live: the tier that owns them, asked by
the rest of the runtime for everything that differs between the host and a home device.

[Note: state tiers]
A bucket's tier (`bucket.tier`, set by `Bucket.rehome` when the placement moves it: [Note: optimizer placement];
every bucket starts on `HOST`) answers what the runtime used to ask by branching on the bucket's home: where a
gradient download lands and where its spare buffer goes (`download_buffer`, `return_spare`: execution's gradient
commits), what must be waited for after the bucket's kernels (`settle`), whether the bucket steps exactly under the
lagged step (`steps_exactly_when_lagged`) and which buckets one optimizer call may step together (`step_group`: the
step policies, the optimizer), whether an exact step leaves the compute copy to be written back later
(`stale_compute_after_exact_step`) and what a look does (`on_look`: `synchronize()`), the trace track of its steps
(`track`), whether its uploads and gradients cross PCIe (`crosses_pcie`: the measured profile), whether a task's
gradients stay on the device that computed them (`grads_stay_on`: the worker's one backward), whether its weights do
(`weights_stay_on`: [Note: one-stage evaluation]) and the device bytes
it holds (`device_bytes`). Only this module and the placement (which registers one `DeviceTier` per home device)
say which tier a bucket is in; nothing else branches on it (tests/test_state_tiers.py counts).

A new tier is one class here plus its registration in `place_optimizer_state`. The disk tier (optimizer copy and
state in swap files under `offload_dir`, read into the bounded staging of `runtime/disk/` around each step:
[Note: disk staging protocol]) will use the hooks that host and device leave as no-ops:
- `will_step(buckets)`: at `step()`, on the caller's thread, the tier's buckets in the order the policy will step
  them (backward order; bottom-up after a clip): the disk tier hands it to `DiskStaging.schedule`, so the reads of
  its optimizer copies and states start ahead of their steps. The staging refuses an acquire out of that order, so
  the disk tier will also have the exact step's job take its buckets in the announced order;
- `before_step(bucket)`: in the bucket's gradient turn, before the optimizer reads its optimizer copy and state:
  `DiskStaging.acquire` (waits for the read) and the optimizer's parameters and state pointed at the slot's views;
- `after_step(bucket)`: after the step and its `settle`: the stepped copy cast into the compute copy (its readers
  read that, see `optim_resident`), then `DiskStaging.release(dirty=True)`, which writes the slot back;
- `optim_resident`: False for the disk, whose optimizer copy is in a slot only during its step: readers must read
  the compute copy, so an exact step of a disk bucket is not `current_for_readers` and is written back in
  `after_step`, and a lagged one is held as a host bucket's is.
That is how `runtime/state/disk_tier.py` uses them ([Note: disk tier]); the optimizer writes an exact step of a disk
bucket into its compute copy before `after_step` and keeps a lagged one apart (`hold_newest`) for its held write-back.
What only a tier that keeps nothing in memory needs has hooks of its own, no-ops here: `ordered_steps` (the exact
step's job takes its buckets in the announced order), `attach` (the optimizer's state and trace), `take_state` and
`showing_state` (a loaded state taken out of memory, a state dict made whole), `resident` and `optim_values` (a
checkpoint's loads and reads, while nothing runs) and `close`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ..devices.device import Device

# A `Bucket` (bucket.py holds a tier and imports this module, so this one names it without importing it).
Bucket = Any


def stand_in(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An optimizer copy holding no values: its size and dtype, one element of memory, and a write into it raises
    (every element is the same one). A disk bucket's between its steps ([Note: disk tier]), every bucket's after the
    engine closed ([Note: memory freed at close]). On the host, named: a finalizer may run it inside the caller's
    `with torch.device("meta")`, which would otherwise make it there, and a parameter's `.data` cannot move to
    another kind of tensor."""
    return torch.zeros((), dtype=dtype, device="cpu").expand(numel)


class StateTier:
    """Where a bucket's optimizer copy, gradient and optimizer state live ([Note: state tiers]). The defaults are
    the host's."""

    device: torch.device | None = None  # the device holding them; None: host memory
    track: str = "optimizer"  # the trace track of the tier's steps
    steps_exactly_when_lagged: bool = False  # [Note: device steps are exact]
    # Buckets of tiers with the same non-None key may go in one optimizer call ([Note: device steps in one call]).
    step_group: Hashable | None = None
    # An exact step leaves the compute copy behind the optimizer copy until a look or a lagged step writes it back
    # ([Note: exact step without write-back]).
    stale_compute_after_exact_step: bool = True
    crosses_pcie: bool = True  # its uploads and gradient downloads go through host memory
    optim_resident: bool = True  # its optimizer copy is always in memory: readers may read it
    # `zero_grad(set_to_none=True)` hands the bucket's gradient buffer to `return_spare` (the host's pool:
    # [Note: no spare gradient buffer]); a device bucket keeps it, its views made once.
    gives_back_cleared_grads: bool = True
    # The optimizer's `.grad` views of the bucket's last two gradient buffers are kept
    # ([Note: device gradient buffers reused]); host buffers come from a pool shared by every bucket.
    keeps_grad_views: bool = False
    # The exact step takes the tier's buckets in the order `will_step` announced ([Note: exact step order]).
    ordered_steps: bool = False

    def download_buffer(self, bucket: Bucket, like: torch.Tensor, device: Device) -> torch.Tensor:
        """Where `device`'s download of `bucket`'s gradients (sized and typed as `like`) lands
        ([Note: gradient swap]): a buffer of the host's gradient pool."""
        return bucket.grad_pool.take(like)

    def return_spare(self, bucket: Bucket, spare: torch.Tensor) -> None:
        """The buffer a commit into `bucket` let go of, once nobody reads it: back to the host's pool."""
        bucket.grad_pool.give(spare)

    def settle(self) -> None:
        """Wait for the kernels this thread queued on the tier's memory ([Note: device steps are synchronous])."""

    def grads_stay_on(self, device: torch.device) -> bool:
        """Whether gradients computed on `device` are converted in place there, with no download."""
        return False

    def weights_stay_on(self, device: torch.device) -> bool:
        """Whether a task on `device` reads the bucket's weights (after its first step) from memory there, with
        nothing crossing PCIe ([Note: one-stage evaluation]): the tier's own device, when its copies do not cross."""
        return self.device == device and not self.crosses_pcie

    def on_look(self, bucket: Bucket) -> None:
        """`synchronize()`, the optimizer thread idle: make `bucket`'s compute copy show its newest step. The host's
        exact steps were written back by `write_back_stale` already."""

    def device_bytes(self, bucket: Bucket, copies: int) -> int:
        """What `bucket` takes on a device with `copies` optimizer-state tensors of the optimizer copy's size."""
        return 0

    def will_step(self, buckets: list[Bucket]) -> None:
        """The tier's buckets in the order the coming step takes them (a disk tier's prefetch order)."""

    def before_step(self, bucket: Bucket) -> None:
        """Before the optimizer reads `bucket`'s optimizer copy and state, in its gradient turn."""

    def after_step(self, bucket: Bucket) -> None:
        """After `bucket`'s step (settled) and its `step_written`, in its gradient turn."""

    def attach(self, state_of: Callable[[], dict], trace: Any) -> None:
        """The wrapped optimizer's state (`state_of()`: the dict keyed by the optimizer copies' parameters, which a
        load replaces) and its trace recorder (None: off), when an optimizer is wrapped."""

    def take_state(self, bucket: Bucket, state: dict) -> None:
        """`state` (the optimizer's) now holds `bucket`'s entries as loaded: a tier not keeping them in memory
        takes them."""

    @contextlib.contextmanager
    def showing_state(self, bucket: Bucket, state: dict) -> Iterator[None]:
        """While nothing runs: `bucket`'s optimizer state entries complete in `state`, for a state dict."""
        yield

    @contextlib.contextmanager
    def resident(self, bucket: Bucket, write: bool = True) -> Iterator[None]:
        """While nothing runs: `bucket.optim` (its parameters' data) and its optimizer state in memory for the
        caller to read or load into; with `write`, what the caller changed is kept."""
        yield

    def optim_values(self, bucket: Bucket) -> torch.Tensor:
        """While nothing runs: the values of `bucket`'s optimizer copy, to read (a host or device tensor)."""
        return bucket.optim

    def close(self) -> None:
        """The engine is closed: give back what the tier holds outside the store (files, staging)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.device})" if self.device is not None else type(self).__name__


class HostTier(StateTier):
    """Host memory: the CPU steps the bucket, gradients are downloaded into the host's pool."""


HOST = HostTier()  # every bucket's tier until the placement moves it


class DeviceTier(StateTier):
    """A home device ([Note: optimizer placement]): gradients converted into buffers there, the device's own kernel
    steps the bucket, the next task reads the stepped optimizer copy there. One instance per device (`settle` and
    the optimizer's once-per-device wait go by instance)."""

    steps_exactly_when_lagged = True
    step_group = "device"  # every device bucket ready goes in one call, as before: torch groups them by device
    stale_compute_after_exact_step = False  # readers read the device's copy; a look writes the compute copy
    crosses_pcie = False  # after its first step nothing of it crosses
    gives_back_cleared_grads = False
    keeps_grad_views = True

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.track = f"optimizer {self.device}"

    def download_buffer(self, bucket: Bucket, like: torch.Tensor, device: Device) -> torch.Tensor:
        """A buffer on the home device, which becomes the bucket's gradient buffer as a host one would: the spare
        of [Note: device gradient buffers reused] when there is one."""
        spare = bucket.take_spare_grad(like.numel(), like.dtype)
        return spare if spare is not None else device.empty_grads_on(self.device, like.numel(), like.dtype)

    def return_spare(self, bucket: Bucket, spare: torch.Tensor) -> None:
        bucket.give_spare_grad(spare)  # its kernels are done (settle): the next download may convert into it

    def settle(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def grads_stay_on(self, device: torch.device) -> bool:
        return self.device == device

    def on_look(self, bucket: Bucket) -> None:
        bucket.versions.show_current()  # a no-op for a bucket whose compute copy shows its last step

    def device_bytes(self, bucket: Bucket, copies: int) -> int:
        return device_bytes_of(bucket, copies)


def device_bytes_of(bucket: Bucket, copies: int) -> int:
    """A bucket's bytes on a device: its optimizer copy, its gradient, the spare gradient buffer the next download
    converts into ([Note: device gradient buffers reused]) and `copies` state tensors of that size."""
    return bucket.optim.numel() * bucket.optim.element_size() * (3 + copies)

