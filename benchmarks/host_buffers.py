"""Every host buffer a RoundPipe engine holds, counted once by its memory, by what holds it.

Reached only through the engine object and its attributes (`engine.host_store`, its buckets and gradient pool,
`engine.optimizer.state`), never by importing runtime modules by path: the runtime's files move, its objects' names
do not. A buffer is counted once by its storage (`untyped_storage()`: its data pointer and size), so views (the
optimizer's parameters are views of a bucket's optimizer copy; `.grad` views of its gradient) are not counted
twice; the first kind that reaches a storage owns it, in the order of `KINDS`. Tensors on a device (a bucket whose
optimizer state lives on a GPU: [Note: optimizer placement]) are counted apart, as device bytes.
"""

from __future__ import annotations

import torch

KINDS = (
    "compute",  # trainable buckets' compute copies (param dtype): what engine.module's parameters view
    "frozen compute",  # frozen buckets' compute copies, the only copy a frozen parameter has
    "optimizer copies",  # trainable buckets' optimizer copies (float32 master weights)
    "gradients",  # the gradient buffer each trainable bucket holds (valid or not)
    "spare gradients",  # free buffers of the store's gradient pool ([Note: gradient swap])
    "optimizer states",  # optimizer state tensors shaped like their parameter (AdamW: exp_avg, exp_avg_sq)
    "optimizer scalars",  # the other state tensors (AdamW's per-tensor `step`)
    # buckets' `pending`: a deferred pass's gradients held apart ([Note: deferred gradient commit])
    "deferred gradients",
    "stashes",  # a look's copy of the version the next lagged pass reads ([Note: looking changes nothing])
    "disk staging",  # the disk tier's slots its buckets' steps read into and write back from ([Note: disk tier])
)
# The kinds that scale with trainable parameters; "frozen compute" scales with frozen ones.
TRAINABLE_KINDS = tuple(k for k in KINDS if k != "frozen compute")


class HostCount:
    """Bytes per kind, each storage once; page-locked bytes per kind; device bytes apart."""

    def __init__(self) -> None:
        self.bytes = dict.fromkeys(KINDS, 0)
        self.pinned = dict.fromkeys(KINDS, 0)
        self.device_bytes = 0
        self._seen: set[tuple[str, int]] = set()

    def add(self, kind: str, tensor: torch.Tensor | None) -> None:
        if not torch.is_tensor(tensor) or tensor.numel() == 0:
            return
        storage = tensor.untyped_storage()
        key = (str(tensor.device), storage.data_ptr())
        if key in self._seen:
            return
        self._seen.add(key)
        if tensor.device.type != "cpu":
            self.device_bytes += storage.nbytes()
            return
        self.bytes[kind] += storage.nbytes()
        if tensor.is_pinned():
            self.pinned[kind] += storage.nbytes()

    @property
    def total(self) -> int:
        return sum(self.bytes.values())


def count_host_buffers(engine) -> HostCount:
    """What `engine` holds now. Call it while nothing runs (after the passes and steps are done), so that no
    gradient buffer is between the pool and a bucket."""
    store = engine.host_store
    count = HostCount()
    for bucket in store.buckets:
        count.add("compute" if bucket.trainable else "frozen compute", bucket.compute)
    for bucket in store.buckets:
        count.add("optimizer copies", bucket.optim)
    for bucket in store.buckets:
        count.add("gradients", bucket.grad)
    for buffer in pool_buffers(store.grad_pool):
        count.add("spare gradients", buffer)
    optimizer = engine.optimizer
    if optimizer is not None:
        shapes = {id(slot.optim): slot.shape for bucket in store.trainable_buckets for slot in bucket.slots}
        for param, state in optimizer.state.items():
            for value in state.values():
                if torch.is_tensor(value):
                    shaped = value.shape == shapes.get(id(param))
                    count.add("optimizer states" if shaped else "optimizer scalars", value)
    for bucket in store.buckets:
        count.add("deferred gradients", bucket.pending)
        count.add("stashes", bucket.stash)
    placement = engine.optimizer_placement
    for tier in placement.tiers if placement is not None else ():
        staging = getattr(tier, "staging", None)
        if staging is not None:
            count.add("disk staging", staging.memory)
    return count


def pool_buffers(pool) -> list[torch.Tensor]:
    """The free buffers of the store's gradient pool (`GradBufferPool`), checked against its own count."""
    buffers = [t for free in pool._free.values() for t in free]
    assert sum(t.numel() * t.element_size() for t in buffers) == pool.free_bytes(), "the pool changed its layout"
    return buffers


def parameter_counts(engine) -> dict[str, int]:
    """The parameters the store holds, trainable and frozen (each once), and the elements of their buckets (the
    parameters with the store's alignment padding: what a bucket-sized buffer holds)."""
    counts = dict.fromkeys(("trainable_params", "frozen_params", "trainable_elements", "frozen_elements"), 0)
    for bucket in engine.host_store.buckets:
        kind = "trainable" if bucket.trainable else "frozen"
        counts[f"{kind}_params"] += sum(slot.numel for slot in bucket.slots)
        counts[f"{kind}_elements"] += bucket.compute.numel()
    return counts


def dtypes_of(engine) -> dict[str, list[str]]:
    """The dtypes of the compute copies (trainable, frozen) and of the optimizer copies."""
    found: dict[str, set[str]] = {"compute": set(), "frozen compute": set(), "optimizer copies": set()}
    for bucket in engine.host_store.buckets:
        found["compute" if bucket.trainable else "frozen compute"].add(str(bucket.compute.dtype))
        if bucket.optim is not None:
            found["optimizer copies"].add(str(bucket.optim.dtype))
    return {k: sorted(d.removeprefix("torch.") for d in v) for k, v in found.items()}


def torch_pinned_cache() -> dict[str, int]:
    """What torch's caching host allocator holds now and held at most (page-locked memory outside the engine's own
    count: activation and norm downloads on a GPU; part of what a host peak above the start summary's count is made
    of), or nothing without CUDA."""
    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.host_memory_stats()
    return {k: int(v) for k, v in stats.items() if "bytes" in k and k.endswith(("current", "peak"))}
