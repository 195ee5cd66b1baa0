"""Compute copies are page-locked only where their uploads cross PCIe
([Note: compute copies locked where they cross]): frozen buckets at the build, trainable ones once the placement
has said which stay on the host (or before the first pass when nothing was placed); a bucket with a home device
keeps a pageable compute copy, which uploads read only before its first step and which the measured plan does not
time. Locks are recorded by a stand-in for the CUDA runtime, so the tests run on CPU workers; the engine's run checks
float64 results against plain torch."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from accelerate_roundpipe import RoundPipe, RoundPipeConfig
from accelerate_roundpipe.runtime.devices import factory
from accelerate_roundpipe.runtime.devices.stream_model import StreamModelDevice
from accelerate_roundpipe.runtime.state.host_store import HostStore
from accelerate_roundpipe.runtime.state.placement import lock_host_optimizer_copies, place_optimizer_state

from toy_models import batch, plain_adamw_training, tied_model

LR, WEIGHT_DECAY, MAX_NORM = 1e-2, 0.1, 3.0
TOL = dict(rtol=1e-12, atol=1e-12)


def _store(num_blocks: int = 3, frozen: str | None = None) -> HostStore:
    layers = list(tied_model(num_blocks=num_blocks))
    if frozen is not None:
        for name, p in layers[1].named_parameters():
            if name.startswith(frozen):
                p.requires_grad_(False)
    return HostStore(layers, None, None, pin_memory=True, names={}, pin_optimizer_copies=True,
                     defer_compute_locks=True)


def _place(store: HostStore, setting: str, budget_gib: float | None = None):
    """As the measured plan does: the placement, then the host's optimizer copies, then the crossing compute copies."""
    devices = [SimpleNamespace(device=torch.device("cpu"), is_cuda=False)]
    optimizer = torch.optim.AdamW([s.optim for b in store.trainable_buckets for s in b.slots])
    placement = place_optimizer_state(setting, budget_gib, devices, store, optimizer, False, None)
    lock_host_optimizer_copies(store)
    store.lock_crossing_compute_copies()
    return placement


def test_the_build_locks_only_frozen_compute_copies(locks):
    store = _store(frozen="linear")
    frozen = [b for b in store.buckets if not b.trainable]
    assert frozen and store.trainable_buckets
    assert store.locked_copies == {b.index: ("compute",) for b in frozen}
    assert set(locks.locked) == {b.compute.data_ptr() for b in frozen}


def test_device_buckets_keep_pageable_compute_copies_host_buckets_lock_both(locks):
    store = _store()
    placement = _place(store, "device")  # no limit: every bucket goes to its device
    assert placement.host_buckets == [] and placement.device_buckets
    assert store.locked_copies == {}
    assert locks.locked == {} and locks.unlocked == []  # nothing locked, so nothing unlocked (no device synchronize)
    for bucket in store.trainable_buckets:
        assert store.uploads_pageable(bucket.index, bucket.compute[:4])  # a window of it
        assert not store.uploads_pageable(bucket.index, bucket.optim)  # the device's copy: nothing crosses

    store = _store()
    placement = _place(store, "device", budget_gib=0.0)  # a zero budget: every bucket stays on the host
    assert placement.device_buckets == []
    assert store.locked_copies == {b.index: ("compute", "optim") for b in store.trainable_buckets}
    assert not any(store.uploads_pageable(b.index, b.compute) for b in store.buckets)


def test_a_pass_before_any_placement_locks_every_compute_copy_once(locks):
    store = _store()
    store.lock_compute_copies_before_first_pass()
    store.lock_compute_copies_before_first_pass()  # RecordedLocks refuses a second lock of the same memory
    assert store.locked_copies == {b.index: ("compute",) for b in store.buckets}
    _place(store, "device")  # placed afterwards: what is locked stays locked, nothing is locked twice
    assert store.locked_copies == {b.index: ("compute",) for b in store.buckets}


def test_stores_built_without_deferral_lock_compute_copies_at_the_build(locks):
    layers = list(tied_model(num_blocks=2))
    store = HostStore(layers, None, None, pin_memory=True, names={})
    assert store.locked_copies == {b.index: ("compute",) for b in store.buckets}
    store.lock_crossing_compute_copies()  # nothing deferred: nothing more to lock
    assert not any(store.uploads_pageable(b.index, b.compute) for b in store.buckets)
    unpinned = HostStore(list(tied_model(num_blocks=2)), None, None, pin_memory=False, names={},
                         defer_compute_locks=True)
    unpinned.lock_crossing_compute_copies()
    assert unpinned.locked_copies == {} and not unpinned.uploads_pageable(0, unpinned.buckets[0].compute)


@pytest.mark.parametrize("placement", ["device", "host"])
def test_a_pinning_engine_trains_as_plain_torch(monkeypatch, locks, placement):
    """The engine as on a GPU (pin_memory on, locks recorded), on stream-model CPU workers (asynchronous copies
    run late, into poisoned destinations): the device placement leaves the compute copies pageable and the exact
    float64 run still equals plain torch's, looking at the weights after every step."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # pin_memory=True is allowed; locks recorded
    monkeypatch.setattr(factory, "cpu_device_class", StreamModelDevice)
    batches = [[batch(rows=8, seed=10 * step + j) for j in range(2)] for step in range(3)]
    ref_norms, ref_weights = plain_adamw_training(tied_model, batches, MAX_NORM, LR, WEIGHT_DECAY)
    config = RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=2, summary=False, pin_memory=True,
                             optimizer_placement=placement)
    engine = RoundPipe(tied_model(), config)
    try:
        store = engine.host_store
        assert store.locked_copies == {}  # nothing trainable locked before the placement
        optimizer = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=LR, weight_decay=WEIGHT_DECAY))
        expected = {} if placement == "device" else {b.index: ("compute", "optim") for b in store.trainable_buckets}
        assert store.locked_copies == expected
        norms, weights = [], []
        for passes in batches:
            for x, mask, y in passes:
                engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy)
            norms.append(float(optimizer.clip_grad_norm_(MAX_NORM)))
            optimizer.step()
            optimizer.zero_grad()
            engine.synchronize()
            weights.append({name: p.detach().clone() for name, p in engine.module.named_parameters()})
        assert store.locked_copies == expected  # the passes locked nothing more
        torch.testing.assert_close(norms, ref_norms, **TOL)
        for ours, theirs in zip(weights, ref_weights):
            for name, tensor in theirs.items():
                torch.testing.assert_close(ours[name], tensor, **TOL, msg=name)
    finally:
        engine.close()
