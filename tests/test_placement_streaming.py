"""`optimizer_placement="auto"` keeps every bucket on the host when the weights stream and the host step hides under
the streaming ([Note: a host step hidden by streamed weights]); where the weights fit, or the host step is longer,
or the user asked for the device or a device budget, it places as before."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from accelerate_roundpipe.runtime.state.host_store import HostStore
from accelerate_roundpipe.runtime.state.placement import host_step_hidden_by_streaming, place_optimizer_state

from toy_models import tied_model

GPU = [SimpleNamespace(device=torch.device("cpu"), is_cuda=True)]  # a GPU as the placement sees one


def _store(trainable_blocks: int | None) -> HostStore:
    """A tied model's host store; only the last `trainable_blocks` layers trainable (None: every parameter)."""
    layers = list(tied_model(num_blocks=4))
    if trainable_blocks is not None:
        for layer in layers[:-trainable_blocks]:
            layer.requires_grad_(False)
    return HostStore(layers, None, None, pin_memory=False, names={})


def _weights(store: HostStore) -> int:
    return sum(b.compute.numel() * b.compute.element_size() for b in store.buckets)


def _place(store, memory_budget_bytes, setting="auto", budget_gib=None):
    params = [s.optim for b in store.trainable_buckets for s in b.slots]
    return place_optimizer_state(setting, budget_gib, GPU, store, torch.optim.AdamW(params), False,
                                 memory_budget_bytes)


def test_streamed_weights_with_a_small_trainable_part_keep_the_state_on_the_host():
    store = _store(trainable_blocks=1)  # a LoRA-like share: most weights frozen
    budget = 0.9 * _weights(store)  # the weights do not fit: they stream
    reason = host_step_hidden_by_streaming(store, budget)
    assert reason is not None and "stream twice a step" in reason and "hides under it" in reason
    placement = _place(store, budget)
    assert placement.device_buckets == []
    assert placement.summary().startswith("auto: all ") and "hides under it" in placement.summary()


def test_weights_that_fit_or_a_long_host_step_place_as_before():
    store = _store(trainable_blocks=1)
    assert host_step_hidden_by_streaming(store, 10 * _weights(store)) is None  # the weights fit
    assert host_step_hidden_by_streaming(store, None) is None  # CPU workers: no budget
    full = _store(trainable_blocks=None)  # full fine-tuning: the host step moves 7 optimizer copies
    assert host_step_hidden_by_streaming(full, 0.9 * _weights(full)) is None
    assert _place(full, 0.9 * _weights(full)).device_buckets != []


def test_an_explicit_device_setting_or_budget_is_the_users():
    store = _store(trainable_blocks=1)
    budget = 0.9 * _weights(store)
    assert _place(store, budget, setting="device").device_buckets != []
    store = _store(trainable_blocks=1)
    assert _place(store, budget, budget_gib=1.0).device_buckets != []
