"""Loss and every gradient of the engine equal plain PyTorch (float64, CPU workers)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from accelerate_roundpipe import RoundPipe, RoundPipeConfig

from toy_models import assert_close, batch, reference_loss_and_grads, run_layers, tied_model

RTOL = 1e-10
PARTITIONS = {
    "planned": {},
    # Every layer in the fused stage: the tied weight is used twice inside one stage.
    "one_stage": {"backward_stages": [9]},
    # Uneven hand-made split with the tie across stages and multi-layer backward stages.
    "hand": {"forward_stages": [2, 3], "backward_stages": [2, 3, 4]},
}


def engine_loss_and_grads(model, x, mask, y, **config):
    engine = RoundPipe(copy.deepcopy(model), RoundPipeConfig(seed=0, **config))
    loss = engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy)
    engine.synchronize()
    grads = {n: p.grad.clone() for n, p in engine.named_parameters()}
    engine.close()
    return loss, grads


def check(loss, grads, ref_loss, ref_grads):
    assert_close(loss, ref_loss, RTOL, "loss")
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert grad.dtype == torch.float64
        assert_close(grad, ref_grads[name], RTOL, f"grad of {name}")


@pytest.mark.parametrize("partition", PARTITIONS)
@pytest.mark.parametrize("recompute", ["stage", "layer"])
@pytest.mark.parametrize("num_devices", [1, 2, 3])
def test_split_equals_whole_batch(num_devices, recompute, partition):
    model = tied_model(dropout=0.0)
    x, mask, y = batch(rows=11)
    ref_loss, ref_grads = reference_loss_and_grads(model, x, mask, y)
    for num_mb in range(1, 9):  # 11 rows: most splits are uneven
        for per_round in {None, num_devices}:  # one round, and rounds of one micro-batch per device
            loss, grads = engine_loss_and_grads(model, x, mask, y, devices=["cpu"] * num_devices,
                                                num_microbatches=num_mb, microbatches_per_round=per_round,
                                                recompute=recompute, **PARTITIONS[partition])
            check(loss, grads, ref_loss, ref_grads)


@pytest.mark.parametrize("recompute", ["stage", "layer"])
@pytest.mark.parametrize("num_devices", [1, 2, 3])
def test_dropout_masks_replayed_in_recompute(num_devices, recompute):
    """With dropout the engine equals a plain run using the same per-layer, per-micro-batch masks: so the
    recomputation drew exactly the forward's masks (otherwise the gradients would not match)."""
    model = tied_model(dropout=0.4)
    x, mask, y = batch(rows=11)
    for num_mb in (1, 3, 4, 8):
        ref_loss, ref_grads = reference_loss_and_grads(model, x, mask, y, num_microbatches=num_mb)
        loss, grads = engine_loss_and_grads(model, x, mask, y, devices=["cpu"] * num_devices,
                                            num_microbatches=num_mb, recompute=recompute, microbatches_per_round=2)
        check(loss, grads, ref_loss, ref_grads)
        whole_loss, _ = reference_loss_and_grads(model, x, mask, y)
        assert abs(loss.item() - whole_loss.item()) > 1e-6, "dropout should be active in this test"


def test_tied_weight_stored_once_and_gradients_summed():
    model = tied_model()
    engine = RoundPipe(model, RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=2))
    names = [n for n, _ in engine.named_parameters()]
    assert "0.linear.weight" in names and "8.linear.weight" not in names  # the tie has one name, one copy
    assert model[0].linear.weight is model[8].linear.weight
    shared = [b for b in engine._store.buckets if len(b.layers) > 1]
    assert len(shared) == 1 and shared[0].layers == (0, 8)
    engine.close()


def test_sum_reduction_and_grad_scale():
    model = tied_model()
    x, mask, y = batch(rows=8)
    ref = copy.deepcopy(model)
    ref_loss = nn.functional.cross_entropy(run_layers(ref, (x, mask)), y, reduction="sum")
    (ref_loss * 0.25).backward()
    engine = RoundPipe(copy.deepcopy(model), RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=3))
    loss = engine.forward_backward(x, mask, labels=y, loss_reduction="sum", grad_scale=0.25,
                                   loss_fn=lambda out, t: nn.functional.cross_entropy(out, t, reduction="sum"))
    engine.synchronize()
    assert_close(loss, ref_loss.detach(), RTOL, "summed loss")
    for (name, p), (_, q) in zip(engine.named_parameters(), ref.named_parameters()):
        assert_close(p.grad, q.grad, RTOL, name)
    engine.close()


@pytest.mark.parametrize("recompute", ["stage", "layer"])
def test_forward_pipeline_then_backward_pipeline(recompute):
    """`out = model(x)` then any function of `out` `.backward()` equals plain PyTorch."""
    model = tied_model()
    x, mask, y = batch(rows=10)
    ref = copy.deepcopy(model)
    ref_out = run_layers(ref, (x, mask))
    (nn.functional.cross_entropy(ref_out, y) + ref_out.pow(2).mean()).backward()
    engine = RoundPipe(copy.deepcopy(model), RoundPipeConfig(devices=["cpu"] * 3, num_microbatches=5,
                                                             recompute=recompute))
    out = engine(x, mask)
    assert_close(out.detach(), ref_out.detach(), RTOL, "forward output")
    (nn.functional.cross_entropy(out, y) + out.pow(2).mean()).backward()
    engine.synchronize()
    for (name, p), (_, q) in zip(engine.named_parameters(), ref.named_parameters()):
        assert_close(p.grad, q.grad, RTOL, name)
    with torch.no_grad():
        assert not engine(x, mask).requires_grad
    engine.close()


def test_accumulation_and_synchronize_lose_nothing():
    model = tied_model()
    x, mask, y = batch(rows=12)
    _, g1 = reference_loss_and_grads(model, x[:6], mask[:6], y[:6])
    _, g2 = reference_loss_and_grads(model, x[6:], mask[6:], y[6:])
    engine = RoundPipe(copy.deepcopy(model), RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=3))
    engine.forward_backward(x[:6], mask[:6], labels=y[:6], loss_fn=nn.functional.cross_entropy)
    engine.synchronize()
    engine.forward_backward(x[6:], mask[6:], labels=y[6:], loss_fn=nn.functional.cross_entropy)
    engine.synchronize()
    for name, p in engine.named_parameters():
        assert_close(p.grad, g1[name] + g2[name], RTOL, name)
    engine.close()


def test_frozen_parameters_get_no_gradient_or_optimizer_copy():
    model = tied_model()
    for p in model[1].parameters():
        p.requires_grad_(False)
    x, mask, y = batch(rows=6)
    _, ref_grads = reference_loss_and_grads(model, x, mask, y)
    engine = RoundPipe(copy.deepcopy(model), RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=2))
    engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy)
    engine.synchronize()
    for name, p in engine.named_parameters():
        if name.startswith("1."):
            assert not p.requires_grad and p.grad is None
            assert p is dict(engine.module.named_parameters())[name]  # the compute copy, never stepped
        else:
            assert_close(p.grad, ref_grads[name], RTOL, name)
    frozen = [b for b in engine._store.buckets if not b.trainable]
    assert frozen and all(b.optim is None and b.grad is None for b in frozen)
    engine.close()


@pytest.mark.parametrize("recompute", ["stage", "layer"])
@pytest.mark.parametrize("num_devices, expect_kept", [(1, True), (2, True), (3, False)])
def test_saved_inputs_kept_on_the_reading_worker(monkeypatch, num_devices, expect_kept, recompute):
    """[Note: saved inputs]: with a memory budget, inputs whose backward runs on the same worker stay there (no host
    round trip), the others take the host path, and the gradients stay exact. Schedule F0 F1 FB B1 B0 dispatched
    round-robin: on 2 devices each forward stage's reader is its own device, on 3 devices never."""
    from accelerate_roundpipe.runtime.execution.worker import Worker

    kept: list[bool] = []
    original = Worker._save_input

    def spy(self, job, layer, mb, h):
        original(self, job, layer, mb, h)
        kept.append(job.results.saved_input(layer, mb).worker_index == self.device.index)

    monkeypatch.setattr(Worker, "_save_input", spy)
    model = tied_model(dropout=0.3)
    x, mask, y = batch(rows=9)
    ref_loss, ref_grads = reference_loss_and_grads(model, x, mask, y, num_microbatches=3)
    loss, grads = engine_loss_and_grads(model, x, mask, y, devices=["cpu"] * num_devices, num_microbatches=3,
                                        recompute=recompute, gpu_memory_budget=1, **PARTITIONS["hand"])
    check(loss, grads, ref_loss, ref_grads)
    assert kept and all(k == expect_kept for k in kept)
    kept.clear()
    loss, grads = engine_loss_and_grads(model, x, mask, y, devices=["cpu"] * num_devices, num_microbatches=3,
                                        recompute=recompute, **PARTITIONS["hand"])
    check(loss, grads, ref_loss, ref_grads)
    assert kept and not any(kept)  # no budget on CPU workers: the host path, as on a GPU


def test_layer_copies_hold_no_device_tensors_between_tasks():
    """After a task its layer copies are unbound: a bound view would keep the task's whole parameter flat and its
    gradient buffer alive on the device until the layer ran again."""
    model = tied_model()
    x, mask, y = batch(rows=6)
    engine = RoundPipe(copy.deepcopy(model), RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=3))
    engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy)
    engine.synchronize()
    copies = [c for w in engine._dispatch.workers for c in w.residency.copies.values()]
    assert copies and all(module._parameters[attr] is None for c in copies for module, attr, _ in c._targets)
    engine.close()


def test_loss_returns_before_the_fused_backward_and_gradients_stay_exact(monkeypatch):
    """The fused stage hands the loss over before its backward: with a slow backward, `forward_backward` returns
    while the pass is still running, and synchronize() then gives the exact gradients."""
    import time

    from accelerate_roundpipe.runtime.execution import worker

    original = worker._backward
    finished: list[float] = []

    def slow_backward(outputs, grads):
        time.sleep(0.2)
        original(outputs, grads)
        finished.append(time.perf_counter())

    monkeypatch.setattr(worker, "_backward", slow_backward)
    model = tied_model()
    x, mask, y = batch(rows=4)
    ref_loss, ref_grads = reference_loss_and_grads(model, x, mask, y)
    engine = RoundPipe(copy.deepcopy(model), RoundPipeConfig(devices=["cpu"], num_microbatches=1, seed=0,
                                                             backward_stages=[9]))
    loss = engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy)
    returned = time.perf_counter()
    engine.synchronize()
    assert len(finished) == 9 and returned < finished[-1]  # returned while the backward (9 x 0.2 s) was running
    grads = {n: p.grad.clone() for n, p in engine.named_parameters()}
    check(loss, grads, ref_loss, ref_grads)
    engine.close()
