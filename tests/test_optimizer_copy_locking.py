"""Optimizer copies are page-locked only where the placement keeps them on the host
([Note: optimizer copies locked after the placement]): exact steps upload them from there, while a bucket moved
to its device never reads its host copy again. Locks are recorded by a stand-in for the CUDA runtime, so the test
runs on CPU workers."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from accelerate_roundpipe.runtime.state.host_store import HostStore
from accelerate_roundpipe.runtime.state.placement import lock_host_optimizer_copies, place_optimizer_state

from toy_models import tied_model


def _store() -> HostStore:
    layers = list(tied_model(num_blocks=3))
    return HostStore(layers, None, None, pin_memory=True, names={}, pin_optimizer_copies=True)


def _placed(store: HostStore, setting: str, budget_gib: float | None = None):
    devices = [SimpleNamespace(device=torch.device("cpu"), is_cuda=False)]
    optimizer = torch.optim.AdamW([s.optim for b in store.trainable_buckets for s in b.slots])
    placement = place_optimizer_state(setting, budget_gib, devices, store, optimizer, False, None)
    lock_host_optimizer_copies(store)  # as the measured plan does after the device and disk placements
    return placement


def test_the_build_locks_compute_copies_and_leaves_optimizer_copies_unlocked(locks):
    store = _store()
    assert store.trainable_buckets
    for bucket in store.buckets:
        assert bucket.compute.data_ptr() in locks.locked
        if bucket.optim is not None:
            assert bucket.optim.data_ptr() not in locks.locked


def test_host_buckets_have_their_optimizer_copy_locked_device_buckets_never(locks):
    store = _store()
    host_optims = {b.index: b.optim.data_ptr() for b in store.trainable_buckets}
    assert not any(ptr in locks.locked for ptr in host_optims.values())
    placement = _placed(store, "device", budget_gib=0.0)  # a zero budget: every bucket stays on the host
    assert placement.device_buckets == []
    assert all(ptr in locks.locked for ptr in host_optims.values())

    store = _store()
    unlocked_before = len(locks.unlocked)  # (the first store's finalizer may unlock its buffers meanwhile)
    placement = _placed(store, "device")  # no limit: every bucket goes to its device
    assert placement.host_buckets == []
    for bucket in store.trainable_buckets:
        assert bucket.optim.data_ptr() not in locks.locked  # the device copy
    assert len(locks.unlocked) == unlocked_before  # nothing locked for nothing: no unlock, no device synchronize


def test_unpinned_stores_lock_nothing_and_a_bucket_is_locked_once(locks):
    layers = list(tied_model(num_blocks=2))
    store = HostStore(layers, None, None, pin_memory=False, names={}, pin_optimizer_copies=True)
    _placed(store, "host")
    assert locks.locked == {}
    store = _store()
    bucket = store.trainable_buckets[0]
    store.lock_optimizer_copy(bucket)
    store.lock_optimizer_copy(bucket)  # RecordedLocks refuses a second lock of the same memory
    assert bucket.optim.data_ptr() in locks.locked
