"""Where each trainable bucket's optimizer state lives: on a home device or in host memory.

[Note: optimizer placement]
A trainable bucket has three things the optimizer owns: its float32 (or float64) optimizer copy, its gradient and
the optimizer's state for it (AdamW's two moments). On the host, the CPU steps them as the bucket's gradients land:
about 28 bytes a parameter through the host's memory per step, which on one H200's host (Qwen3-1.7B, ~121 GB/s)
made the exact step wait on the host between two iterations (the Trainer at its defaults at 0.78x in-GPU training).
A bucket placed on a *home device* keeps all three there: its gradients are converted into its gradient buffer on
the device (no download), the optimizer's own kernel for that device steps it (torch's fused CUDA AdamW), and the
next task reads the stepped optimizer copy on the device, cast into the compute dtype there (no upload). Nothing of
it crosses PCIe or touches host memory until someone looks at the weights (`synchronize()`, a checkpoint).

What goes where (`plan_placement`): the buckets whose host step would be exposed first, which are the ones that land
last in the backward and are needed first by the next forward: the bottom layers, and a tied embedding (its lowest
layer is 0). So buckets are taken bottom-up while they fit in the device budget (`optimizer_device_budget`, default
`DEVICE_SHARE` of the GPU memory budget; the rest stays for the stages and saved inputs, whose plan is made in what
is left); a bucket that does not fit stays on the host and the next ones are tried. A model whose buckets all fit
trains with nothing on the host's critical path. On several devices each bucket's home is the device with the most
budget left; a task on another device reads and sends gradients across devices.

The placement is made once, when the optimizer is wrapped (its class says how much state it keeps), and never
changes during the run; a checkpoint is in the optimizer's own format and resumes under any placement (torch's
`load_state_dict` moves each state tensor to its parameter's device). Under data parallelism the gradients of every
bucket go through the host's gloo exchange, so "auto" keeps the host and "device" is refused.

The step stays exact by default: device buckets take the same tickets and events as host buckets. With
`async_optimizer` they still step exactly ([Note: device steps are exact]).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field

import torch

from ...telemetry.summary import summary_size
from ..disk import DiskBandwidth, OffloadSettingError, available_memory_bytes, default_host_memory_budget
from ..disk import remove_leftovers as remove_swap_leftovers
from .bucket import Bucket
from .disk_tier import DiskPlan, DiskTier, host_state_bytes, plan_disk, state_names
from .tiers import HOST, DeviceTier, StateTier, device_bytes_of

logger = logging.getLogger(__name__)
GiB = 2**30

DEVICE_SHARE = 0.5  # of the GPU memory budget, the default device budget of the optimizer placement
# [Note: a host step hidden by streamed weights]: conservative rates for the estimate of "auto"
HOST_STEP_BYTES_PER_S = 50e9  # host memory traffic of a CPU AdamW step (an H200 host measured about 121 GB/s)
HOST_STEP_TRAFFIC = 7  # AdamW moves 7 optimizer-copy sizes: parameter, gradient, two moments read; three written
STREAM_BYTES_PER_S = 25e9  # PCIe per direction, as the measured plan assumes before it has measured


def host_step_hidden_by_streaming(store, memory_budget_bytes: float | None) -> str | None:
    """Why "auto" keeps every bucket on the host when the weights stream, or None
    ([Note: a host step hidden by streamed weights]).

    [Note: a host step hidden by streamed weights]
    When the compute copies do not fit the GPU memory budget, every pass streams the weights over PCIe: twice a
    step (forward, then backward). That bounds the step from below, and the host's step of every trainable bucket,
    run as gradients land, hides under it when it is shorter. Optimizer state on the device then buys next to
    nothing and costs the pipeline the memory it would size its micro-batches with: Qwen3-30B-A3B's LoRA on the
    experts under a 24 GiB cap (1.0B adapter parameters, about 0.6 s of host step against 4.9 s of streaming at
    25 GB/s) gave 12 GiB of the card to the adapters' state and ran micro-batches of 1 row at 7.7 s a step, where
    4 rows ran 4.9 s. So "auto" places nothing there; `optimizer_placement="device"` or an explicit
    `optimizer_device_budget` still does. Where the weights fit, the host step is the step's critical path and
    "auto" places as before."""
    if memory_budget_bytes is None:
        return None
    weights = sum(b.compute.numel() * b.compute.element_size() for b in store.buckets)
    if weights <= memory_budget_bytes:
        return None
    optim_bytes = sum(b.optim.numel() * b.optim.element_size() for b in store.trainable_buckets if b.optim is not None)
    host_step_s = optim_bytes * HOST_STEP_TRAFFIC / HOST_STEP_BYTES_PER_S
    stream_s = 2 * weights / STREAM_BYTES_PER_S
    if host_step_s >= stream_s:
        return None
    return (f"the weights ({weights / 2**30:.1f} GiB) stream twice a step (about {stream_s:.1f} s); the host step "
            f"(about {host_step_s:.1f} s) hides under it, so the GPU memory goes to the pipeline")


def state_copies(optimizer: torch.optim.Optimizer) -> int:
    """How many optimizer-copy-sized tensors `optimizer` keeps per parameter (AdamW: 2 moments; 3 with amsgrad;
    SGD: 1 with momentum). Other classes are assumed to keep 2, as Adam does."""
    groups = optimizer.param_groups
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return 3 if any(g.get("amsgrad") for g in groups) else 2
    if isinstance(optimizer, torch.optim.SGD):
        return 1 if any(g.get("momentum") for g in groups) else 0
    return 2


@dataclass(frozen=True)
class BucketPlace:
    """Where one trainable bucket's optimizer state lives, and why."""

    bucket: int
    layers: tuple[int, ...]
    numel: int
    device_bytes: int  # what it takes on a device: optimizer copy, gradient and state
    home: str | None  # its device; None: the host
    reason: str

    def __str__(self) -> str:
        where = self.home or "host"
        return (f"bucket{self.bucket:<4} layers {_layers(self.layers):<10} {self.numel / 1e6:9.2f} M params "
                f"{self.device_bytes / 2**30:7.3f} GiB  {where:<8} {self.reason}")


@dataclass(frozen=True)
class DiskPlacement:
    """The disk tier's part of a placement ([Note: disk tier]): plain data for the summary and the tests."""

    plan: DiskPlan
    folder: str  # this run's swap folder
    bandwidth: DiskBandwidth | None

    @property
    def step_seconds(self) -> float | None:
        """What the disk's measured bandwidth implies for one step: every disk bucket read and written once."""
        if self.bandwidth is None or not self.plan.file_bytes:
            return None
        nbytes = self.plan.file_bytes
        return nbytes / (self.bandwidth.read_gbps * 1e9) + nbytes / (self.bandwidth.write_gbps * 1e9)


@dataclass(frozen=True)
class OptimizerPlacement:
    """The placement of every trainable bucket (plain data: print it, test it)."""

    setting: str  # optimizer_placement: auto, host or device
    budget_bytes: float | None  # per device; None: no limit
    places: tuple[BucketPlace, ...]
    host_budget_bytes: int | None = None  # host_memory_budget, as resolved
    host_state_bytes: int = 0  # optimizer copies, gradients and states of the host's buckets
    disk: DiskPlacement | None = None
    tiers: tuple[StateTier, ...] = field(default=(), compare=False, repr=False)  # what `close()` closes

    @property
    def device_buckets(self) -> list[int]:
        return [p.bucket for p in self.places if p.home is not None]

    @property
    def disk_buckets(self) -> list[int]:
        return sorted(self.disk.plan.buckets) if self.disk is not None else []

    @property
    def host_buckets(self) -> list[int]:
        on_disk = set(self.disk_buckets)
        return [p.bucket for p in self.places if p.home is None and p.bucket not in on_disk]

    @property
    def disk_bytes(self) -> int:
        return self.disk.plan.file_bytes if self.disk is not None else 0

    @property
    def staging_bytes(self) -> int:
        """The disk tier's staging slots: host memory the disk buckets' steps read into and write back from."""
        return self.disk.plan.staging_bytes if self.disk is not None else 0

    def tiers_line(self) -> str:
        """The start summary's line: buckets and GiB in each tier, and the disk's measured bandwidth."""
        line = (f"device {len(self.device_buckets)} buckets {summary_size(self.device_bytes())}, host "
                f"{len(self.host_buckets)} buckets {summary_size(self.host_state_bytes)}, disk "
                f"{len(self.disk_buckets)} buckets {summary_size(self.disk_bytes)}")
        if self.host_budget_bytes is not None:
            line += f" (host_memory_budget {summary_size(self.host_budget_bytes)})"
        disk = self.disk
        if disk is not None:
            line += f"; swap files in {disk.folder}"
            if disk.bandwidth is not None:
                line += (f"; disk measured at {disk.bandwidth.write_gbps:.2f} GB/s write, "
                         f"{disk.bandwidth.read_gbps:.2f} GB/s read: about {_seconds(disk.step_seconds)} s a step to "
                         f"read and write its buckets")
            if not disk.plan.fits:
                line += (f"; the store still needs {summary_size(disk.plan.host_bytes)} with every bucket it can move "
                         f"on disk")
        return line

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()

    def device_bytes(self, home: str | None = None) -> int:
        """Bytes placed on `home` (every device when None)."""
        return sum(p.device_bytes for p in self.places if p.home is not None and home in (None, p.home))

    def most_on_one_device(self) -> int:
        """The bytes placed on the device holding the most (0 with none)."""
        return max((self.device_bytes(home) for home in {p.home for p in self.places if p.home is not None}),
                   default=0)

    def summary(self) -> str:
        """One line for the start summary (the disk tier's buckets, stepped by the host, count as the host's here;
        `tiers_line` tells them apart)."""
        on_device = self.device_buckets
        total = len(self.places)
        on_disk = f", {len(self.disk_buckets)} of them with their state on disk" if self.disk_buckets else ""
        if not on_device:
            why = self.places[0].reason if self.places else "no trainable parameters"
            return f"{self.setting}: all {total} trainable buckets on the host ({why}){on_disk}"
        homes = sorted({p.home for p in self.places if p.home is not None})
        numel = sum(p.numel for p in self.places if p.home is not None)
        budget = "no limit" if self.budget_bytes is None else f"{self.budget_bytes / 2**30:.1f} GiB per device"
        return (f"{self.setting}: {len(on_device)} of {total} trainable buckets ({numel / 1e6:.1f} M params, "
                f"{self.device_bytes() / 2**30:.2f} GiB) on {', '.join(homes)}, stepped there; "
                f"{total - len(on_device)} on the host (budget {budget}){on_disk}")

    def __str__(self) -> str:
        return "\n".join([f"optimizer placement ({self.summary()})", *(f"  {p}" for p in self.places)])


def _seconds(s: float) -> str:
    """An estimate's seconds to three figures, never in exponent notation (130.745 reads 131, 0.00123 as it is)."""
    return f"{s:.0f}" if s >= 100 else f"{s:.3g}"




def _layers(layers: tuple[int, ...]) -> str:
    return str(layers[0]) if len(layers) == 1 else ",".join(str(i) for i in layers)


def plan_placement(setting: str, buckets: list[Bucket], homes: list[torch.device], budget_bytes: float | None,
                   copies: int, host_reason: str | None = None) -> OptimizerPlacement:
    """Place `buckets` (the trainable ones) bottom-up on the devices `homes` while each device's `budget_bytes`
    allows (None: no limit); `host_reason`, when given, keeps every bucket on the host and says why."""
    left = {str(home): budget_bytes for home in homes}
    places = []
    for bucket in sorted(buckets, key=lambda b: (min(b.layers), b.index)):  # bottom layers, tied embeddings first
        need = device_bytes_of(bucket, copies)
        home, reason = None, host_reason
        if host_reason is None:
            fits = [h for h, room in left.items() if room is None or need <= room]
            if fits:
                home = max(fits, key=lambda h: float("inf") if left[h] is None else left[h])
                if left[home] is not None:
                    left[home] -= need
                reason = "first layers: their step is not hidden behind the backward" if min(bucket.layers) == 0 \
                    else "fits the device budget"
            else:
                reason = "over the device budget"
        places.append(BucketPlace(bucket.index, bucket.layers, bucket.optim.numel(), need, home, reason))
    return OptimizerPlacement(setting, budget_bytes, tuple(sorted(places, key=lambda p: p.bucket)))


def move_home(bucket: Bucket, tier: DeviceTier) -> None:
    """Move `bucket`'s optimizer copy and gradient to `tier`'s device (ordinary device memory); the host's are given
    back. Called while nothing runs (the optimizer is being wrapped)."""
    home = tier.device
    with torch.no_grad():
        optim = bucket.optim.to(home, copy=True)
        grad = bucket.grad.to(home, copy=True) if bucket.grad_valid else torch.zeros_like(optim)
        pending = bucket.pending.to(home, copy=True) if bucket.pending is not None else None
    bucket.rehome(tier, optim, grad, pending)


def place_optimizer_state(setting: str, budget_gib: float | None, devices: list, store,
                          optimizer: torch.optim.Optimizer, data_parallel: bool,
                          memory_budget_bytes: float | None) -> OptimizerPlacement:
    """Decide the placement for `optimizer` (wrapped now) on the workers' `devices` (`Device`s) and move the device
    buckets home ([Note: optimizer placement]). `budget_gib`: `optimizer_device_budget`; `memory_budget_bytes`: the
    GPU memory the engine plans with (None for CPU workers). The disk's part is `place_past_host_budget`'s."""
    homes = list({str(d.device): d.device for d in devices}.values())
    host_reason = None
    if setting == "host":
        host_reason = "optimizer_placement=host"
    elif data_parallel:
        if setting == "device":
            raise ValueError("optimizer_placement='device' (--roundpipe_optimizer_placement, env "
                             "ROUNDPIPE_OPTIMIZER_PLACEMENT) is not supported under data parallelism yet: every "
                             "bucket's gradients are exchanged through the host. Use 'auto' or 'host'.")
        host_reason = "data parallelism exchanges gradients on the host"
    elif setting == "auto" and not any(d.is_cuda for d in devices):
        host_reason = "CPU workers gain nothing from it; optimizer_placement=device places it anyway"
    elif setting == "auto" and budget_gib is None:
        host_reason = host_step_hidden_by_streaming(store, memory_budget_bytes)
    if budget_gib is not None:
        budget = budget_gib * 2**30
    else:
        budget = None if memory_budget_bytes is None else DEVICE_SHARE * memory_budget_bytes
    placement = plan_placement(setting, store.trainable_buckets, homes, budget, state_copies(optimizer), host_reason)
    tiers: dict[str, DeviceTier] = {}  # one per home device ([Note: state tiers])
    for place in placement.places:
        if place.home is not None:
            bucket = store.buckets[place.bucket]
            old_optim, old_grad = bucket.optim, bucket.grad
            move_home(bucket, tiers.setdefault(place.home, DeviceTier(torch.device(place.home))))
            store.memory.give_back(old_optim)
            if old_grad is not None:  # gradients held before the placement ([Note: no spare gradient buffer])
                store.grad_pool.give(old_grad)
    return dataclasses.replace(placement, tiers=tuple(tiers.values()))


def lock_host_optimizer_copies(store) -> None:
    """After the placements (device, then disk): page-lock the optimizer copies of the buckets that stayed on the
    host, which exact steps upload ([Note: optimizer copies locked after the placement]). Locked before the disk's
    placement, the copies of buckets moved to disk were locked and unlocked again for nothing."""
    for bucket in store.trainable_buckets:
        if bucket.tier is HOST:
            store.lock_optimizer_copy(bucket)


def place_past_host_budget(placement: OptimizerPlacement, store, optimizer: torch.optim.Optimizer,
                           data_parallel: bool, host_budget_gib: float | None, offload_dir: str,
                           timeout_s: float, budget_given: str | None = None) -> OptimizerPlacement:
    """After `place_optimizer_state`: the buckets the host keeps past `host_budget_gib` (`host_memory_budget`;
    None: the default) moved to the disk tier, their swap files under `offload_dir` ([Note: disk tier]).
    `budget_given`: the setting as the user gave it (`RoundPipeConfig.setting_as_given`), for the refusals."""
    copies = state_copies(optimizer)
    on_host = [store.buckets[p.bucket] for p in placement.places if p.home is None]
    names = state_names(optimizer)
    fixed = sum(b.compute.numel() * b.compute.element_size() for b in store.buckets)
    if host_budget_gib is None:  # [Note: default host memory budget], the store's own memory counted as available
        held = fixed + sum(b.optim.numel() * b.optim.element_size() for b in on_host)
        host_budget_gib = default_host_memory_budget(available_memory_bytes() + held)
        budget_given = (f"the default host_memory_budget, {host_budget_gib:.3g} GiB (the memory available less "
                        f"20%, at least 4 GiB; host_memory_budget, --roundpipe_host_memory_budget or "
                        f"ROUNDPIPE_HOST_MEMORY_BUDGET sets it)")
    budget_bytes = int(host_budget_gib * GiB)
    plan = plan_disk(on_host, fixed, budget_bytes,
                     names if names is not None else tuple(f"state{i}" for i in range(copies)))
    host_bytes = sum(host_state_bytes(b, copies) for b in on_host if b.index not in plan.buckets)
    placement = dataclasses.replace(placement, host_budget_bytes=budget_bytes, host_state_bytes=host_bytes)
    if not plan.buckets:
        if os.path.isdir(offload_dir):
            remove_swap_leftovers(os.path.abspath(offload_dir))  # a killed run's, even when no bucket goes there
        return placement
    _refuse_disk(plan, names, optimizer, data_parallel, host_budget_gib, budget_given)
    if not plan.fits:
        # in the sizes of the summary's tiers line: "0.01 GiB needs 0.01 GiB" said nothing on a small model
        logger.warning("RoundPipe: host_memory_budget is %s, and the store needs %s of host memory even with the "
                       "optimizer state of every trainable bucket on disk (compute copies and gradients stay); "
                       "training goes on, over the budget.", summary_size(budget_bytes), summary_size(plan.host_bytes))
    disk_buckets = [store.buckets[i] for i in plan.buckets]
    disk = DiskTier.open(disk_buckets, names, offload_dir, timeout_s, memory=store.memory)
    for bucket in disk_buckets:
        old_optim = bucket.optim
        bucket.rehome(disk, disk.stand_in_of(bucket), bucket.grad, bucket.pending)
        store.memory.give_back(old_optim)
    return dataclasses.replace(placement, disk=DiskPlacement(plan, disk.folder, disk.bandwidth),
                               tiers=(*placement.tiers, disk))


def _refuse_disk(plan: DiskPlan, names: tuple[str, ...] | None, optimizer: torch.optim.Optimizer,
                 data_parallel: bool, budget_gib: float, budget_given: str | None = None) -> None:
    """What the disk tier cannot do yet, refused before anything is written, naming the settings (where the user
    gave them: a variable named for a value given elsewhere, or for the default, sends the user looking for an
    export that does not exist) and the numbers."""
    given = budget_given or f"host_memory_budget={budget_gib:.3g} GiB"
    need = (f"{given}: the store needs "
            f"{plan.host_bytes_before / GiB:.3f} GiB of host memory, so {len(plan.buckets)} trainable bucket(s) "
            f"would keep their optimizer state on disk")
    fix = f"raise host_memory_budget to at least {plan.host_bytes_before / GiB:.3f} GiB (everything on the host)"
    if data_parallel:
        raise OffloadSettingError(f"{need}, which is not supported under data parallelism yet (gradients and state "
                                  f"are sharded on the host). {fix[0].upper() + fix[1:]}, or train on one process.")
    if names is None:
        raise OffloadSettingError(f"{need}, which keeps the state of torch's Adam, AdamW and SGD only, not of "
                                  f"{type(optimizer).__module__}.{type(optimizer).__qualname__}. Use one of those, "
                                  f"or {fix}.")
