"""Weights the user changed in place after wrapping, seen by the version counters of the model's own parameters.

[Note: weight edits followed]
The model's parameters are views of the buckets' compute copies, and the optimizer copies are what a step writes
and (after an exact step) what the next uploads read. A change the user makes to a parameter in place after
wrapping (`model.load_state_dict(...)`, `torch.nn.init.*_`, a pruning mask applied with `p.mul_(mask)` under
`no_grad`, PEFT's merge) wrote only the compute copy: the next upload read the optimizer copy and the next step
overwrote the change, silently (a `load_state_dict` after one step of SGD: loss 3.94, where the loaded weights give
4.17). Each in-place operation on a parameter bumps that parameter's version counter, and the engine's own writes
never do (they go through the buckets' flat buffers, of which the parameters are not views in autograd's sense:
their `.data` was set). So at each call that reads or steps the weights (a pass, `optimizer.step()`,
`synchronize()` and so every look, save and state dict) the engine compares every trainable parameter's version
with the one it recorded (a tenth of a microsecond each) and, where one moved:
1. keeps the edited parameters' values aside,
2. waits for everything in flight and looks (the compute copies then hold the newest weights, which a look writes
   over the edits),
3. writes the kept values back into the compute copies and from there into the optimizer copies (cast to the
   optimizer dtype), into the newest weights a lagged step holds and into a look's stash, so every reader reads
   them next (`WeightVersions.edited_in_compute`);
4. records the versions again.
Frozen parameters need none of this (their compute copy is what every pass uploads), only a new content generation
so that no device copy of the old values is shared with a later pass (`FrozenEdits`, [Note: shared frozen weights]);
a frozen edit while a pass still runs (between `optimizer.step()` and the next pass) may be read by that pass's last
backward stages. Not seen: writes through
`p.data` (a tensor with a version counter of its own) and through a tensor kept from before wrapping. An edit made
while the weights shown are one step old (after `optimizer.step()`, before any look) is applied to those values,
as reading them shows them: look first (`synchronize()`, a state dict) before an edit that reads the weights; a
Trainer callback that takes `model` gets a look before it runs.
"""

from __future__ import annotations

import torch

from .bucket import Bucket
from .host_store import HostStore


class WeightEdits:
    """The recorded version of every parameter of `buckets` (the store's trainable ones unless given); see
    [Note: weight edits followed]. Owned by the engine's caller thread."""

    def __init__(self, store: HostStore, buckets: list[Bucket] | None = None) -> None:
        self._slots = [(bucket, index, slot.param)
                       for bucket in (store.trainable_buckets if buckets is None else buckets)
                       for index, slot in enumerate(bucket.slots)]
        self._versions: list[int] = []
        self.followed = 0  # how many looks took in an edit
        self.record()

    def record(self) -> None:
        """The parameters as they are now are the engine's."""
        self._versions = [param._version for _, _, param in self._slots]

    def took_in(self) -> None:
        """An edit was applied to every copy: record, and count it."""
        self.record()
        self.followed += 1

    def edited(self) -> dict[int, tuple[Bucket, list[int]]]:
        """bucket index -> (bucket, the indices of its slots whose parameter was changed in place since `record`)."""
        edits: dict[int, tuple[Bucket, list[int]]] = {}
        for (bucket, index, param), version in zip(self._slots, self._versions):
            if param._version != version:
                edits.setdefault(bucket.index, (bucket, []))[1].append(index)
        return edits


class FrozenEdits:
    """The frozen parameters' versions (`WeightEdits` over the frozen buckets). Frozen weights are never written by
    the engine, so an in-place change by the user needs nothing but a new `Bucket.content_generation`: a device copy
    uploaded before it is then not shared with a task after it ([Note: shared frozen weights]). Owned by the
    engine's caller thread."""

    def __init__(self, store: HostStore) -> None:
        self._edits = WeightEdits(store, [bucket for bucket in store.buckets if not bucket.trainable])

    def follow(self) -> None:
        """Count up the content generation of every frozen bucket one of whose parameters changed since last."""
        edits = self._edits.edited()
        if edits:
            for bucket, _ in edits.values():
                bucket.content_changed()
            self._edits.record()


def kept_values(edits: dict[int, tuple[Bucket, list[int]]]) -> dict[tuple[int, int], torch.Tensor]:
    """The edited parameters' values, copied before a look writes the compute copies."""
    return {(bucket.index, i): bucket.slots[i].param.detach().clone()
            for bucket, slots in edits.values() for i in slots}


def apply_edits(edits: dict[int, tuple[Bucket, list[int]]], values: dict[tuple[int, int], torch.Tensor]) -> None:
    """Steps 3 of [Note: weight edits followed], while nothing runs: the kept values into every copy readers read."""
    for bucket, slots in edits.values():
        spans = []
        with torch.no_grad():
            for i in slots:
                slot = bucket.slots[i]
                bucket.compute[slot.offset:slot.offset + slot.numel].copy_(values[(bucket.index, i)].reshape(-1))
                spans.append((slot.offset, slot.offset + slot.numel))
        with bucket.tier.resident(bucket):  # one bucket in memory at a time ([Note: disk tier])
            bucket.versions.edited_in_compute(spans)
