"""The engine on several GPUs of one machine (one process, each GPU a worker): the paper's setting, "GPUs as a
worker pool". Each task's activations cross from one GPU to the next through page-locked host memory, each
worker's layers draw dropout masks from its own GPU's generator, and with the optimizer state on the GPUs a
bucket homed on one GPU is read by tasks on the other. The other GPU tests give one GPU to several workers; these
need two distinct GPUs and are skipped otherwise (CI has none; `bash scripts/device/bench.sh two-gpus` runs them on
a lent machine with two).

Checked against plain PyTorch on cuda:0: losses and gradients (float32, against a float64 reference), dropout
replayed in the recomputation, every optimizer placement over several steps with clipping and accumulation, and the
exact and lagged steps.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_gpu import check_staleness_rule, gpu_reference
from test_gpu_optimizer_placement import batches, engine_training, plain_cuda_training
from torch import nn

from accelerate_roundpipe import RoundPipe, RoundPipeConfig

from toy_models import assert_close, batch, reference_loss_and_grads, tied_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]
RTOL = 1e-5


def all_gpus() -> list[str]:
    return [f"cuda:{i}" for i in range(torch.cuda.device_count())]


# Two workers on two GPUs; three workers on two (one GPU runs two workers); one worker on every GPU.
DEVICE_SETS = {"two": lambda: ["cuda:0", "cuda:1"], "three-on-two": lambda: ["cuda:0", "cuda:1", "cuda:1"],
               "every": all_gpus}


@pytest.fixture(autouse=True)
def no_tf32(monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


@pytest.mark.parametrize("devices", sorted(DEVICE_SETS))
@pytest.mark.parametrize("recompute", ["stage", "layer"])
def test_losses_and_gradients_equal_plain_torch(devices, recompute):
    devices = DEVICE_SETS[devices]()
    model32 = tied_model().float()
    x, mask, y = batch(rows=11)
    ref_loss, ref_grads = reference_loss_and_grads(copy.deepcopy(model32).double(), x, mask, y)
    for num_mb in (1, 3, 4, 8):
        engine = RoundPipe(copy.deepcopy(model32), RoundPipeConfig(devices=devices, num_microbatches=num_mb, seed=0,
                                                                   recompute=recompute, plan="static"))
        try:
            assert [str(d.device) for d in engine.devices] == devices
            loss = engine.forward_backward(x.float(), mask, labels=y, loss_fn=nn.functional.cross_entropy)
            engine.synchronize()
            assert_close(loss.double(), ref_loss, RTOL, f"loss ({num_mb} micro-batches on {devices})")
            for name, p in engine.named_parameters():
                assert p.device.type == "cpu"
                assert_close(p.grad.double(), ref_grads[name], RTOL, f"grad of {name} ({num_mb} on {devices})")
        finally:
            engine.close()


def test_the_measured_plan_spreads_the_work_over_both_gpus():
    """The measured first pass, then re-planned passes: both GPUs run tasks, and the gradients stay exact."""
    model32 = tied_model().float()
    x, mask, y = batch(rows=12)
    ref_loss, ref_grads = reference_loss_and_grads(copy.deepcopy(model32).double(), x, mask, y)
    for index in (0, 1):
        torch.cuda.reset_peak_memory_stats(index)
    engine = RoundPipe(copy.deepcopy(model32), RoundPipeConfig(devices=["cuda:0", "cuda:1"], num_microbatches=4,
                                                               seed=0))
    try:
        for _ in range(3):
            engine.zero_grad(set_to_none=True)
            loss = engine.forward_backward(x.float(), mask, labels=y, loss_fn=nn.functional.cross_entropy)
            engine.synchronize()
            assert_close(loss.double(), ref_loss, RTOL, "loss")
            for name, p in engine.named_parameters():
                assert_close(p.grad.double(), ref_grads[name], RTOL, f"grad of {name}")
        used = [torch.cuda.max_memory_allocated(index) for index in (0, 1)]
        assert all(peak > 0 for peak in used), f"a GPU ran nothing: peaks {used}"
    finally:
        engine.close()


def test_dropout_is_replayed_on_the_gpu_that_recomputes():
    """A layer's dropout mask is drawn again in the recomputation; with two GPUs the forward and the backward of a
    layer may run on different GPUs, whose generators, seeded alike, draw the same masks."""
    model32 = tied_model(dropout=0.4).float()
    x, mask, y = batch(rows=9)
    # plain PyTorch on cuda:0 with each layer seeded as the engine seeds the GPU its task runs on
    ref_loss, ref_grads = gpu_reference(model32, x.float(), mask, y, num_mb=3)
    engine = RoundPipe(copy.deepcopy(model32), RoundPipeConfig(devices=["cuda:0", "cuda:1"], num_microbatches=3,
                                                               seed=0, plan="static"))
    try:
        loss = engine.forward_backward(x.float(), mask, labels=y, loss_fn=nn.functional.cross_entropy)
        engine.synchronize()
        assert_close(loss, ref_loss, RTOL, "loss")
        for name, p in engine.named_parameters():
            assert_close(p.grad, ref_grads[name], RTOL, f"grad of {name}")
    finally:
        engine.close()


@pytest.mark.parametrize("placement", ["host", "device", "auto"])
def test_every_placement_trains_as_plain_torch(placement):
    """With the optimizer state on the GPUs the buckets are homed on both ([Note: optimizer placement]: each on the
    device with the most room), so tasks on one GPU read the weights of buckets stepped on the other."""
    model = tied_model().float()
    data = batches()
    expected = plain_cuda_training(model, data)
    engine, weights = engine_training(model, data, ["cuda:0", "cuda:1"], placement)
    try:
        where = engine.optimizer_placement
        if placement == "host":
            assert where.device_buckets == []
        else:
            homes = {str(engine.host_store.buckets[i].home) for i in where.device_buckets}
            assert homes == {"cuda:0", "cuda:1"}, str(where)
        for name, value in expected.items():
            assert_close(weights[name].double(), value.double(), 2e-5, f"{placement}: {name}")
    finally:
        engine.close()


def test_the_lagged_step_on_two_gpus_follows_the_staleness_rule():
    """`async_optimizer=True` with the state on the host: iteration k computes with the weights after step k-2."""
    check_staleness_rule(["cuda:0", "cuda:1"], "host")
