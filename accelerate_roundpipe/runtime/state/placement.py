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

from dataclasses import dataclass

import torch

from .bucket import Bucket
from .tiers import DeviceTier, device_bytes_of

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
class OptimizerPlacement:
    """The placement of every trainable bucket (plain data: print it, test it)."""

    setting: str  # optimizer_placement: auto, host or device
    budget_bytes: float | None  # per device; None: no limit
    places: tuple[BucketPlace, ...]

    @property
    def device_buckets(self) -> list[int]:
        return [p.bucket for p in self.places if p.home is not None]

    @property
    def host_buckets(self) -> list[int]:
        return [p.bucket for p in self.places if p.home is None]

    def device_bytes(self, home: str | None = None) -> int:
        """Bytes placed on `home` (every device when None)."""
        return sum(p.device_bytes for p in self.places if p.home is not None and home in (None, p.home))

    def most_on_one_device(self) -> int:
        """The bytes placed on the device holding the most (0 with none)."""
        return max((self.device_bytes(home) for home in {p.home for p in self.places if p.home is not None}),
                   default=0)

    def summary(self) -> str:
        """One line for the start summary."""
        on_device = self.device_buckets
        total = len(self.places)
        if not on_device:
            why = self.places[0].reason if self.places else "no trainable parameters"
            return f"{self.setting}: all {total} trainable buckets on the host ({why})"
        homes = sorted({p.home for p in self.places if p.home is not None})
        numel = sum(p.numel for p in self.places if p.home is not None)
        budget = "no limit" if self.budget_bytes is None else f"{self.budget_bytes / 2**30:.1f} GiB per device"
        return (f"{self.setting}: {len(on_device)} of {total} trainable buckets ({numel / 1e6:.1f} M params, "
                f"{self.device_bytes() / 2**30:.2f} GiB) on {', '.join(homes)}, stepped there; "
                f"{total - len(on_device)} on the host (budget {budget})")

    def __str__(self) -> str:
        return "\n".join([f"optimizer placement ({self.summary()})", *(f"  {p}" for p in self.places)])


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
    GPU memory the engine plans with (None for CPU workers)."""
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
        if place.home is None:  # its optimizer copy stays on the host, uploaded by exact steps
            store.lock_optimizer_copy(store.buckets[place.bucket])
        else:
            bucket = store.buckets[place.bucket]
            old_optim, old_grad = bucket.optim, bucket.grad
            move_home(bucket, tiers.setdefault(place.home, DeviceTier(torch.device(place.home))))
            store.memory.give_back(old_optim)
            if old_grad is not None:  # gradients held before the placement ([Note: no spare gradient buffer])
                store.grad_pool.give(old_grad)
    return placement
