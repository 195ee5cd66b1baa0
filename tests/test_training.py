"""Training steps: the lagged optimizer follows the staleness rule exactly, in async and sync mode."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from accelerate_roundpipe import RoundPipe, RoundPipeConfig

from toy_models import assert_close, batch, reference_loss_and_grads, tied_model

RTOL = 1e-10
NUM_STEPS = 6
LRS = [1e-2, 2e-2, 5e-3, 1e-2, 3e-2, 1e-2]  # changed between steps: the step uses the value at step() time


def reference_training(model, batches, async_optimizer: bool, num_mb: int, dropout: bool, exact_first: int = 0):
    """Plain PyTorch AdamW where iteration k's gradients use the weights after steps 0..k-2 (async) or 0..k-1 (sync,
    and async while step k-1 was one of the `exact_first` warm-up steps)."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LRS[0], weight_decay=0.1)
    snapshots = [copy.deepcopy(model.state_dict())]  # snapshots[j]: weights after j steps
    losses = []
    for k, (x, mask, y) in enumerate(batches):
        version = max(0, k - 1) if async_optimizer and k > exact_first else k
        probe = copy.deepcopy(model)
        probe.load_state_dict(snapshots[version])
        loss, grads = reference_loss_and_grads(probe, x, mask, y, num_microbatches=num_mb if dropout else None,
                                               pass_index=k)
        losses.append(loss)
        for name, p in model.named_parameters():
            p.grad = grads[name].clone()
        for group in optimizer.param_groups:
            group["lr"] = LRS[k]
        optimizer.step()
        optimizer.zero_grad()
        snapshots.append(copy.deepcopy(model.state_dict()))
    return model, losses


@pytest.mark.parametrize("plan, num_devices", [("static", 3), ("measured", 3), ("measured", 1)])
@pytest.mark.parametrize("dropout", [False, True])
@pytest.mark.parametrize("async_optimizer", [True, False])
def test_steps_follow_the_staleness_rule(async_optimizer, dropout, plan, num_devices):
    """Also across the re-plan of [Note: measured plan]: the partition changes after the first step (one device:
    every layer in the fused stage, no recomputation) and the training stays exact."""
    model = tied_model(dropout=0.3 if dropout else 0.0)
    batches = [batch(rows=9, seed=10 + k) for k in range(NUM_STEPS)]
    num_mb = 4
    ref_model, ref_losses = reference_training(model, batches, async_optimizer, num_mb, dropout)

    engine = RoundPipe(copy.deepcopy(model), RoundPipeConfig(devices=["cpu"] * num_devices, num_microbatches=num_mb,
                                                             seed=0, microbatches_per_round=3, plan=plan,
                                                             async_optimizer=async_optimizer))
    optimizer = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=LRS[0], weight_decay=0.1))
    losses, partitions = [], []
    for k, (x, mask, y) in enumerate(batches):
        losses.append(engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy))
        partitions.append(engine.partition)
        for group in optimizer.param_groups:
            group["lr"] = LRS[k]
        optimizer.step()
        optimizer.zero_grad()
    engine.synchronize()
    for k, (loss, ref) in enumerate(zip(losses, ref_losses)):
        assert_close(loss, ref, RTOL, f"loss of iteration {k}")
    reference = dict(ref_model.named_parameters())
    for name, p in engine.module.named_parameters():
        assert_close(p.detach(), reference[name].detach(), RTOL, f"weight {name}")
    for name, p in engine.named_parameters():  # optimizer copies agree with the compute copies
        assert_close(p.detach(), reference[name].detach(), RTOL, f"optimizer copy {name}")
    if plan == "static":
        assert len(set(partitions)) == 1 and engine.layer_costs is None
    else:
        assert engine.layer_costs is not None and engine.layer_costs.num_layers == len(model)
        assert len(set(partitions[1:])) == 1  # re-planned once, before the second pass
        if num_devices == 1:
            assert partitions[-1].forward == () and len(partitions[-1].fused) == len(model)
    engine.close()


def test_async_differs_from_sync():
    """Guard for the test above: the two rules give different weights, so each test pins its own rule."""
    model = tied_model()
    batches = [batch(rows=9, seed=10 + k) for k in range(3)]
    a, _ = reference_training(model, batches, True, 4, False)
    s, _ = reference_training(model, batches, False, 4, False)
    assert not torch.allclose(a[0].linear.weight, s[0].linear.weight)


def test_lr_scheduler_and_optimizer_state_dict_round_trip():
    """Stop after 3 steps, resume in a new engine (weights, optimizer, scheduler, engine RNG state): the next 3
    steps give what an uninterrupted run gives, dropout masks included."""
    model = tied_model(dropout=0.3)
    batches = [batch(rows=8, seed=30 + k) for k in range(6)]

    def train(engine, optimizer, scheduler, items):
        for x, mask, y in items:
            engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy)
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()

    def build(module):
        engine = RoundPipe(module, RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=2))
        optimizer = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-2))
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return engine, optimizer, scheduler

    engine, optimizer, scheduler = build(copy.deepcopy(model))
    train(engine, optimizer, scheduler, batches[:3])
    weights = {k: v.clone() for k, v in engine.state_dict().items()}  # synchronizes
    opt_state = copy.deepcopy(optimizer.state_dict())
    sched_state = scheduler.state_dict()
    engine_state = engine.engine_state()
    assert opt_state["state"] and opt_state["param_groups"][0]["lr"] == pytest.approx(5e-3)
    train(engine, optimizer, scheduler, batches[3:])
    engine.synchronize()
    expected = {k: v.clone() for k, v in engine.module.state_dict().items()}

    resumed, optimizer2, scheduler2 = build(copy.deepcopy(model))
    resumed.load_state_dict(weights)
    resumed.load_engine_state(engine_state)
    optimizer2.load_state_dict(opt_state)
    scheduler2.load_state_dict(sched_state)
    train(resumed, optimizer2, scheduler2, batches[3:])
    resumed.synchronize()
    for name, value in resumed.module.state_dict().items():
        assert_close(value, expected[name], RTOL, name)
    engine.close()
    resumed.close()


def test_zero_grad_semantics():
    model = tied_model()
    x, mask, y = batch(rows=6)
    engine = RoundPipe(copy.deepcopy(model), RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=2))
    optimizer = engine.wrap_optimizer(torch.optim.SGD(engine.parameters(), lr=0.1))
    engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy)
    optimizer.zero_grad(set_to_none=False)
    engine.synchronize()
    assert all(p.grad is not None and not p.grad.any() for p in engine.parameters())
    engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy)
    optimizer.zero_grad()  # set_to_none=True, like torch
    engine.synchronize()
    assert all(p.grad is None for p in engine.parameters())
    before = {n: p.detach().clone() for n, p in engine.named_parameters()}
    optimizer.step()  # no gradients: nothing moves, as in torch
    engine.synchronize()
    assert all(torch.equal(before[n], p) for n, p in engine.named_parameters())
    _, ref_grads = reference_loss_and_grads(model, x, mask, y)
    engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy)
    engine.synchronize()
    for name, p in engine.named_parameters():
        assert_close(p.grad, ref_grads[name], RTOL, name)
    engine.close()


def test_any_torch_optimizer_and_fused_adamw_by_default():
    model = tied_model()
    engine = RoundPipe(copy.deepcopy(model), RoundPipeConfig(devices=["cpu"], num_microbatches=2))
    adamw = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-3))
    assert adamw.param_groups[0]["fused"] is True
    sgd = engine.wrap_optimizer(torch.optim.SGD(engine.parameters(), lr=1e-3, momentum=0.9))
    x, mask, y = batch(rows=4)
    engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy)
    sgd.step()
    engine.synchronize()
    assert sgd.state_dict()["state"], "the wrapped SGD kept momentum state"
    engine.close()


def test_load_optimizer_copies_keeps_full_precision():
    model = tied_model().float()
    engine = RoundPipe(model, RoundPipeConfig(devices=["cpu"], param_dtype="bfloat16"))
    exact = {n: torch.randn_like(p) for n, p in engine.named_parameters()}
    engine.load_optimizer_copies(exact)
    for name, p in engine.named_parameters():
        assert torch.equal(p.detach(), exact[name])  # not rounded through bfloat16
        assert torch.equal(dict(engine.module.named_parameters())[name], exact[name].bfloat16())
    x, mask, y = batch(rows=4)
    engine.forward_backward(x.bfloat16(), mask, labels=y, loss_fn=nn.functional.cross_entropy)  # no false alarm
    engine.close()


def test_async_warmup_takes_exact_steps_first():
    """`async_warmup_steps=2`: iterations 1 and 2 see the step before them, later ones lag by one; the warm-up's
    position is part of the engine state, so a resumed run stays on the same schedule."""
    model = tied_model()
    batches = [batch(rows=8, seed=30 + k) for k in range(NUM_STEPS)]
    ref_model, ref_losses = reference_training(model, batches, True, 2, False, exact_first=2)
    engine = RoundPipe(copy.deepcopy(model), RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=2,
                                                             async_optimizer=True, async_warmup_steps=2))
    optimizer = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=LRS[0], weight_decay=0.1))
    for k, (x, mask, y) in enumerate(batches):
        loss = engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy)
        assert_close(loss, ref_losses[k], RTOL, f"loss of iteration {k}")
        for group in optimizer.param_groups:
            group["lr"] = LRS[k]
        optimizer.step()
        optimizer.zero_grad()
    engine.synchronize()
    assert engine.engine_state()["optimizer_steps"] == NUM_STEPS
    reference = dict(ref_model.named_parameters())
    for name, p in engine.named_parameters():
        assert_close(p.detach(), reference[name].detach(), RTOL, f"optimizer copy {name}")
    engine.close()


def test_engine_zero_grad_forgets_gradients_without_losing_the_next_ones():
    """`engine.zero_grad()` (nn.Module's would set `.grad` behind the buckets' back: the next pass's gradients then
    never reached `.grad`), with and without a wrapped optimizer."""
    from toy_models import batch, reference_loss_and_grads, tied_model

    for wrap in (False, True):
        model = tied_model()
        x, mask, y = batch()
        _, expected = reference_loss_and_grads(model, x, mask, y, num_microbatches=2)
        engine = RoundPipe(model, RoundPipeConfig(devices=["cpu"], num_microbatches=2))
        if wrap:
            engine.wrap_optimizer(torch.optim.SGD(engine.parameters(), lr=0.0))
        for _ in range(2):
            engine.forward_backward(x, mask, labels=y, loss_fn=torch.nn.functional.cross_entropy)
            engine.synchronize()
            for name, p in engine.named_parameters():
                assert p.grad is not None, name
                torch.testing.assert_close(p.grad, expected[name], rtol=1e-12, atol=1e-14, msg=name)
            engine.zero_grad()
            engine.synchronize()  # the optimizer's zero_grad is queued in the gradients' order
            assert all(p.grad is None for p in engine.parameters()), wrap
        engine.close()
