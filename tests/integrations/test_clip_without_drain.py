"""[Note: clipping without a drain]: the clip handed to the optimizer is torch's clip, exactly, for the exact and the
lagged step, with and without accumulation; the norm comes back before the backward is done and is filled in when
read; the device-measured squared norms are the buckets' own."""

from __future__ import annotations

import copy
import json
import pickle
import time

import pytest
import torch
from integration_unit_helpers import lm_batch, tiny_llama

from accelerate_roundpipe import RoundPipeConfig, wrap_model
from accelerate_roundpipe.integrations.grad_norm import clip_grad_norm
from accelerate_roundpipe.runtime.common import faults
from accelerate_roundpipe.runtime.stepping.step_norm import PendingGradNorm

MAX_NORM = 0.05  # well below the tiny model's gradient norm: the clip is active every step


def _engine(async_optimizer: bool):
    model = tiny_llama().double()
    engine = wrap_model(model, RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=2,
                                               async_optimizer=async_optimizer))
    optimizer = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-2, weight_decay=0.1))
    return engine, optimizer


def _train(async_optimizer: bool, accumulation: int, lazy: bool, steps: int = 4):
    """Steps of clipped AdamW; `lazy`: the optimizer's clip, else synchronize and clip in place with torch."""
    engine, optimizer = _engine(async_optimizer)
    norms = []
    for step in range(steps):
        for micro in range(accumulation):
            engine.forward_backward(**lm_batch(seed=10 * step + micro))
        if lazy:
            norm = clip_grad_norm(engine.module.parameters(), [engine], MAX_NORM)
            assert isinstance(norm, PendingGradNorm)  # the whole model, norm 2: the drain-free path
        else:
            engine.synchronize()
            norm = torch.nn.utils.clip_grad_norm_(list(engine.parameters()), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        norms.append(float(norm))
    engine.synchronize()
    weights = {name: p.detach().clone() for name, p in engine.named_parameters()}
    engine.close()
    return norms, weights


@pytest.mark.parametrize("async_optimizer", [False, True])
@pytest.mark.parametrize("accumulation", [1, 2])
def test_the_optimizers_clip_is_torchs_clip(async_optimizer, accumulation):
    """Accumulation 1 uses the device-measured norms, 2 the host fallback (a sum's norm is measured on the host)."""
    lazy_norms, lazy_weights = _train(async_optimizer, accumulation, lazy=True)
    torch_norms, torch_weights = _train(async_optimizer, accumulation, lazy=False)
    assert all(n > MAX_NORM for n in torch_norms)
    torch.testing.assert_close(lazy_norms, torch_norms, rtol=1e-12, atol=0)
    for name, tensor in torch_weights.items():
        torch.testing.assert_close(lazy_weights[name], tensor, rtol=1e-12, atol=1e-14, msg=name)


def test_the_norm_returns_before_the_backward_is_done_and_fills_in_when_read():
    engine, optimizer = _engine(async_optimizer=False)
    commits = []

    def slow_commits(point: str) -> None:
        if point == "commit":
            time.sleep(0.05)
            commits.append(time.monotonic())

    with faults.injected(slow_commits):
        engine.forward_backward(**lm_batch())
        norm = clip_grad_norm(engine.module.parameters(), [engine], MAX_NORM)
        returned = time.monotonic()
        assert norm._pending[0].norm.done is False  # nothing waited for the commits still in flight
        value = norm.item()
    assert commits and max(commits) > returned  # commits landed after clip_grad_norm_ had returned
    assert value == float(norm) > 0 and norm > 0  # filled in once, then an ordinary 0-dim tensor
    optimizer.step()
    engine.close()


def test_a_pending_norm_behaves_as_a_tensor():
    engine, optimizer = _engine(async_optimizer=True)
    engine.forward_backward(**lm_batch())
    norm = optimizer.clip_grad_norm_(float("inf"))
    copied = copy.deepcopy(norm)
    assert type(copied) is torch.Tensor and copied.item() == norm.item()
    assert pickle.loads(pickle.dumps(norm)).item() == norm.item()
    assert json.loads(json.dumps({"grad_norm": norm.item()}))["grad_norm"] == norm.item()
    assert torch.isfinite(norm) and repr(norm).startswith("tensor(")
    with pytest.raises(RuntimeError, match="twice before optimizer.step"):
        optimizer.clip_grad_norm_(1.0)
    optimizer.step()
    engine.close()


def test_device_norms_are_the_buckets_own_until_the_host_sums():
    engine, optimizer = _engine(async_optimizer=False)
    buckets = engine._store.trainable_buckets
    engine.forward_backward(**lm_batch())
    engine.synchronize()
    for bucket in buckets:
        assert bucket.grad_sq is not None  # one download per bucket: the device's measurement stands
        torch.testing.assert_close(bucket.grad_sq, float(torch.linalg.vector_norm(bucket.grad)) ** 2,
                                   rtol=1e-12, atol=0)
    engine.forward_backward(**lm_batch(seed=2))
    engine.synchronize()
    assert all(b.grad_sq is None for b in buckets)  # summed on the host: measured there when asked
    optimizer.zero_grad(set_to_none=False)
    engine.synchronize()
    assert all(b.grad_sq == 0.0 for b in buckets)
    engine.close()
