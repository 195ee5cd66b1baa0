"""The documented engine loop with an LR scheduler built on the user's optimizer (`opt.step(); sched.step()`) gets
no "lr_scheduler.step() before optimizer.step()" warning, as on plain torch, and each step uses the learning rate
the schedule set when `step()` was called (the lagged optimizer reads its groups' settings then)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from accelerate_roundpipe import RoundPipe, RoundPipeConfig

STEPS = 4


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def _batches():
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 4, generator=gen), torch.randn(4, 3, generator=gen)) for _ in range(STEPS)]


def _schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))


def _plain_torch():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = _schedule(optimizer)
    for x, y in _batches():
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("scheduler_on", ["inner", "wrapper"])
@pytest.mark.parametrize("async_optimizer", [False, True], ids=["exact", "lagged"])
def test_the_documented_loop_warns_nothing_and_follows_the_schedule(scheduler_on, async_optimizer):
    engine = RoundPipe(copy.deepcopy(_model()), RoundPipeConfig(devices=["cpu"], num_microbatches=1,
                                                                async_optimizer=async_optimizer))
    inner = torch.optim.SGD(engine.parameters(), lr=0.1)
    used = []  # the learning rate of each bucket's step, seen on the optimizer thread
    inner.register_step_pre_hook(lambda opt, args, kwargs: used.append(opt.param_groups[0]["lr"]))
    scheduler = _schedule(inner) if scheduler_on == "inner" else None
    optimizer = engine.wrap_optimizer(inner)
    scheduler = scheduler or _schedule(optimizer)
    scheduled = []  # the scheduler's learning rate at each step(), read on the caller's thread
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for x, y in _batches():
                engine.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)
                scheduled.append(scheduler.get_last_lr()[0])
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            engine.synchronize()
        messages = [str(w.message) for w in caught if "lr_scheduler" in str(w.message)]
        assert messages == []
        buckets = len(engine._store.trainable_buckets)
        assert buckets >= 1 and len(scheduled) == STEPS
        assert scheduled == pytest.approx([0.1 / (step + 1) for step in range(STEPS)])  # the schedule moved
        assert used == [lr for lr in scheduled for _ in range(buckets)]
        if not async_optimizer:
            weights = dict(engine.module.named_parameters())
            for name, tensor in _plain_torch().items():
                torch.testing.assert_close(weights[name].detach(), tensor, msg=name)
    finally:
        engine.close()
