"""Optimizer state on the GPU ([Note: optimizer placement]): the steps of buckets placed on a device equal plain
PyTorch's on that device (torch's fused CUDA AdamW, clipping, accumulation), for every placement (all on the host,
all on the device, mixed), with one worker or several sharing the GPU; looks and resumes across placements.
Skipped without a GPU (tests/test_optimizer_placement.py checks the same protocol with CPU workers)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from accelerate_roundpipe import RoundPipe, RoundPipeConfig
from accelerate_roundpipe.runtime.state.placement import device_bytes_of

from toy_models import assert_close, batch, tied_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
STEPS, MAX_NORM, LR = 4, 0.05, 3e-3


def batches():
    return [[batch(rows=8, seed=100 + 2 * k + j) for j in range(2)] for k in range(STEPS)]  # 2 passes a step


def plain_cuda_training(model: nn.Sequential, data) -> dict[str, torch.Tensor]:
    """Plain PyTorch on cuda:0: fused AdamW, clip_grad_norm_, two accumulated passes a step."""
    model = copy.deepcopy(model).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, fused=True)
    for step in data:
        for x, mask, y in step:
            h = (x.float().cuda(), mask.cuda())
            for layer in model:
                h = layer(*h) if isinstance(h, tuple) else layer(h)
            nn.functional.cross_entropy(h, y.cuda()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach().cpu() for n, p in model.state_dict().items()}


@pytest.fixture(autouse=True)
def no_tf32(monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # for this file's tests only


def engine_training(model, data, devices, placement, budget=None, async_optimizer=False, look=False):
    """The engine's weights after `data`; returns the engine, still open (the caller closes it)."""
    engine = RoundPipe(copy.deepcopy(model), RoundPipeConfig(
        devices=devices, num_microbatches=2, seed=0, optimizer_placement=placement, optimizer_device_budget=budget,
        async_optimizer=async_optimizer))
    optimizer = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=LR, weight_decay=0.1))
    for step in data:
        for x, mask, y in step:
            engine.forward_backward(x.float(), mask, labels=y, loss_fn=nn.functional.cross_entropy)
        optimizer.clip_grad_norm_(MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        if look:
            engine.state_dict()  # a look between steps changes nothing
    engine.synchronize()
    weights = {n: p.detach().clone() for n, p in engine.module.state_dict().items()}
    return engine, weights


def mixed_budget_gib(model) -> float:
    """A budget that places the first trainable buckets but not all (measured on an engine of the model)."""
    probe = RoundPipe(copy.deepcopy(model), RoundPipeConfig(devices=["cpu"], optimizer_placement="host"))
    try:
        sizes = [device_bytes_of(b, 2) for b in sorted(probe.host_store.trainable_buckets,
                                                       key=lambda b: min(b.layers))]
    finally:
        probe.close()
    return (sum(sizes[: len(sizes) // 2]) + 1) / 2**30


@pytest.mark.parametrize("devices", [["cuda:0"], ["cuda:0", "cuda:0"]])
@pytest.mark.parametrize("placement", ["host", "device", "mixed"])
def test_every_placement_steps_as_plain_torch_on_the_gpu(devices, placement):
    model = tied_model().float()
    data = batches()
    expected = plain_cuda_training(model, data)
    budget = mixed_budget_gib(model) if placement == "mixed" else None
    engine, weights = engine_training(model, data, devices, "device" if placement == "mixed" else placement, budget)
    try:
        where = engine.optimizer_placement
        if placement == "host":
            assert where.device_buckets == []
        elif placement == "device":
            assert where.host_buckets == []
        else:
            assert where.device_buckets and where.host_buckets, str(where)
        for index in where.device_buckets:
            bucket = engine.host_store.buckets[index]
            assert bucket.home == torch.device("cuda:0") and bucket.optim.is_cuda and bucket.grad.is_cuda
        for name, value in expected.items():
            assert_close(weights[name].double(), value.double(), 2e-5, f"{placement}: {name}")
    finally:
        engine.close()


def test_device_steps_are_exact_with_async_optimizer_and_looking_changes_nothing():
    model = tied_model().float()
    data = batches()
    engine, exact = engine_training(model, data, ["cuda:0", "cuda:0"], "device")
    engine.close()
    engine, lagged = engine_training(model, data, ["cuda:0", "cuda:0"], "device", async_optimizer=True, look=True)
    engine.close()
    for name, value in exact.items():
        assert torch.equal(lagged[name], value), name


@pytest.mark.parametrize("first, then", [("device", "host"), ("host", "device")])
def test_a_checkpoint_resumes_under_another_placement(first, then):
    model = tied_model().float()
    data = batches()
    engine, uninterrupted = engine_training(model, data, ["cuda:0"], first)
    engine.close()
    engine, _ = engine_training(model, data[:2], ["cuda:0"], first)
    optimizer_state = copy.deepcopy(engine.optimizer.state_dict())
    copies = {n: p.detach().cpu().clone() for n, p in engine.named_parameters()}
    engine.close()
    resumed = RoundPipe(copy.deepcopy(model), RoundPipeConfig(devices=["cuda:0"], num_microbatches=2, seed=0,
                                                             optimizer_placement=then))
    optimizer = resumed.wrap_optimizer(torch.optim.AdamW(resumed.parameters(), lr=LR, weight_decay=0.1))
    resumed.load_optimizer_copies(copies)
    optimizer.load_state_dict(optimizer_state)
    for step in data[2:]:
        for x, mask, y in step:
            resumed.forward_backward(x.float(), mask, labels=y, loss_fn=nn.functional.cross_entropy)
        optimizer.clip_grad_norm_(MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
    resumed.synchronize()
    for name, p in resumed.module.state_dict().items():
        assert_close(p.double(), uninterrupted[name].double(), 2e-5, f"{first} -> {then}: {name}")
    resumed.close()


def test_placed_buckets_give_their_host_memory_back():
    model = tied_model().float()
    host = RoundPipe(copy.deepcopy(model), RoundPipeConfig(devices=["cuda:0"], optimizer_placement="host"))
    host.wrap_optimizer(torch.optim.AdamW(host.parameters()))
    device = RoundPipe(copy.deepcopy(model), RoundPipeConfig(devices=["cuda:0"], optimizer_placement="device"))
    device.wrap_optimizer(torch.optim.AdamW(device.parameters()))
    assert device.host_store.memory.locked_bytes < host.host_store.memory.locked_bytes
    assert "on cuda:0, stepped there" in device.optimizer_placement.summary()
    host.close()
    device.close()
