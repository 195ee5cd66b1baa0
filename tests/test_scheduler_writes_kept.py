"""A learning-rate scheduler built on the user's optimizer writes its groups from the caller's thread while the
optimizer thread steps the previous step's buckets; no such write may be lost: every step runs with the learning
rate the schedule set before its `step()` ([Note: one owner of the step's groups] in `runtime/stepping/steppers.py`)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from accelerate_roundpipe import RoundPipe, RoundPipeConfig

STEPS = 120
LAYERS = 4


def _lr(step: int) -> float:
    return 0.01 * (1.0 / (step + 1))  # as LambdaLR computes it


def test_no_scheduler_write_is_lost_under_the_lagged_step():
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(LAYERS)]
    engine = RoundPipe(nn.Sequential(*layers), RoundPipeConfig(devices=["cpu"], num_microbatches=1,
                                                               async_optimizer=True))
    inner = torch.optim.SGD(engine.parameters(), lr=0.01)
    used: list[float] = []  # the learning rate each bucket's step ran with, seen on the optimizer thread

    def record(opt, args, kwargs) -> None:
        used.append(opt.param_groups[0]["lr"])
        time.sleep(0.001)  # a longer step (a larger layer): the scheduler's write lands while buckets step

    inner.register_step_pre_hook(record)
    scheduler = torch.optim.lr_scheduler.LambdaLR(inner, lambda step: 1.0 / (step + 1))
    optimizer = engine.wrap_optimizer(inner)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 32, generator=gen), torch.randn(4, 32, generator=gen)
    scheduled: list[float] = []  # the scheduler's learning rate at each step(), read on the caller's thread
    try:
        for _ in range(STEPS):
            engine.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)
            scheduled.append(scheduler.get_last_lr()[0])
            optimizer.step()
            scheduler.step()  # lands while this step's buckets are being stepped
            optimizer.zero_grad()
        engine.synchronize()
        buckets = len(engine._store.trainable_buckets)
        assert buckets >= 1 and len(used) == buckets * STEPS  # every bucket's step was seen
        assert scheduled == [_lr(k) for k in range(STEPS)]
        per_step = [used[k * buckets:(k + 1) * buckets] for k in range(STEPS)]
        stale = [k for k, lrs in enumerate(per_step) if lrs != [_lr(k)] * buckets]
        assert stale == [], (f"{len(stale)} of {STEPS} steps ran with a stale learning rate: steps {stale[:10]}, "
                             f"e.g. {per_step[stale[0]]} for {_lr(stale[0])}")
        assert inner.param_groups[0]["lr"] == _lr(STEPS)
    finally:
        engine.close()


class _WatchedSGD(torch.optim.SGD):
    """SGD that records which thread sets any of its attributes after `watch()`."""

    def watch(self) -> None:
        self.writes: list[tuple[str, str]] = []

    def __setattr__(self, name, value) -> None:
        if "writes" in self.__dict__:
            self.writes.append((name, threading.current_thread().name))
        super().__setattr__(name, value)


@pytest.mark.parametrize("async_optimizer", [False, True], ids=["exact", "lagged"])
def test_the_optimizer_thread_never_writes_the_users_optimizer(async_optimizer):
    torch.manual_seed(0)
    engine = RoundPipe(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)),
                       RoundPipeConfig(devices=["cpu"], num_microbatches=1, async_optimizer=async_optimizer))
    inner = _WatchedSGD(engine.parameters(), lr=0.1, momentum=0.9)
    optimizer = engine.wrap_optimizer(inner)
    inner.watch()
    groups = [dict(g) for g in inner.param_groups]
    try:
        for _ in range(3):
            engine.forward_backward(torch.randn(4, 4), labels=torch.randn(4, 3), loss_fn=nn.functional.mse_loss)
            optimizer.clip_grad_norm_(1.0)
            optimizer.step()
            optimizer.zero_grad()
        engine.synchronize()
        assert [w for w in inner.writes if w[1] != threading.main_thread().name] == []
        assert inner.param_groups == groups and not inner.state  # the wrapper holds the state
        assert optimizer.state_dict()["state"][0]["momentum_buffer"] is not None
    finally:
        engine.close()
