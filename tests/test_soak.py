"""Soak: 100 iterations, each with a fault injected at a random `faults.point` (a random occurrence of it, on any
thread), followed by a clean error, a model at one step (or one that refuses to be read: [Note: torn weights]) and
a resume from the last checkpoint that trains exactly as plain PyTorch does."""

from __future__ import annotations

import copy
import random
import time

import pytest
import torch
from torch import nn

from accelerate_roundpipe import EngineClosedError, RoundPipe, RoundPipeConfig
from accelerate_roundpipe.runtime.common import faults
from accelerate_roundpipe.runtime.state.torn import TornWeightsError

from toy_models import assert_close

ITERATIONS = 100
STEPS_PER_RUN = 3
LR, MOMENTUM = 0.1, 0.9


class SoakFault(RuntimeError):
    pass


def _module() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3)).double()


def _batch(step: int):
    gen = torch.Generator().manual_seed(step)
    return torch.randn(4, 4, generator=gen, dtype=torch.float64), torch.randint(0, 3, (4,), generator=gen)


def _plain_steps(model: nn.Module, optimizer: torch.optim.Optimizer, first_step: int, num_steps: int) -> None:
    for step in range(first_step, first_step + num_steps):
        x, y = _batch(step)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def _engine_from(checkpoint: dict) -> tuple[RoundPipe, torch.optim.Optimizer]:
    engine = RoundPipe(_module(), RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=2, async_optimizer=False,
                                                  wait_timeout_s=30))
    engine.load_state_dict(checkpoint["model"])
    optimizer = engine.wrap_optimizer(torch.optim.SGD(engine.parameters(), lr=LR, momentum=MOMENTUM))
    optimizer.load_state_dict(copy.deepcopy(checkpoint["optimizer"]))  # torch loads state tensors without a copy
    engine.load_engine_state(checkpoint["engine"])
    return engine, optimizer


def _train(engine: RoundPipe, optimizer, first_step: int, num_steps: int) -> None:
    for step in range(first_step, first_step + num_steps):
        x, y = _batch(step)
        engine.forward_backward(x, labels=y, loss_fn=nn.functional.cross_entropy)
        optimizer.step()
        optimizer.zero_grad()
    engine.synchronize()


def _plain_after(shadow: tuple, first_step: int, num_steps: int) -> dict[str, torch.Tensor]:
    model, optimizer = copy.deepcopy(shadow)
    _plain_steps(model, optimizer, first_step, num_steps)
    return model.state_dict()


def _assert_weights(state: dict, expected: dict, what: str) -> None:
    for name, value in state.items():
        assert_close(value, expected[name], 1e-10, f"{what}: {name}")


@pytest.mark.slow
def test_random_faults_end_in_a_clean_error_a_consistent_model_and_a_resume():
    rng = random.Random(14)
    model = _module()
    shadow = (model, torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM))  # plain PyTorch, in lockstep
    seed_engine = RoundPipe(_module(), RoundPipeConfig(devices=["cpu"]))
    checkpoint = {"model": seed_engine.state_dict(), "engine": seed_engine.engine_state(),
                  "optimizer": seed_engine.wrap_optimizer(torch.optim.SGD(seed_engine.parameters(), lr=LR,
                                                                          momentum=MOMENTUM)).state_dict()}
    seed_engine.close()
    step = 0  # the checkpoint's step
    outcomes = {"torn": 0, "readable": 0, "no fault reached": 0}
    start = time.monotonic()
    for _ in range(ITERATIONS):
        point = rng.choice(faults.POINTS)
        occurrence = rng.randint(1, 12)
        engine, optimizer = _engine_from(checkpoint)
        began = time.monotonic()
        try:
            with faults.injected(faults.raise_at(point, occurrence, SoakFault)):
                _train(engine, optimizer, step, STEPS_PER_RUN)
            outcomes["no fault reached"] += 1
        except SoakFault:
            assert time.monotonic() - began < 10, f"the fault at {point} took long to surface"
            with pytest.raises(EngineClosedError):  # the engine says it is closed from now on
                engine.forward_backward(*_batch(0)[:1], labels=_batch(0)[1], loss_fn=nn.functional.cross_entropy)
            try:
                state = engine.module.state_dict()
            except TornWeightsError:
                outcomes["torn"] += 1
            else:  # one step for every layer: exactly the plain model after that many steps
                steps = {b.steps.compute for b in engine._store.trainable_buckets}
                assert len(steps) == 1, f"readable but torn after a fault at {point}: {steps}"
                _assert_weights(state, _plain_after(shadow, step, steps.pop()), f"after a fault at {point}")
                outcomes["readable"] += 1
        engine.close()
        # Resume from the checkpoint: one clean step, as plain PyTorch takes it; it becomes the next checkpoint.
        engine, optimizer = _engine_from(checkpoint)
        _train(engine, optimizer, step, 1)
        _plain_steps(*shadow, step, 1)
        _assert_weights(engine.state_dict(), shadow[0].state_dict(), f"resumed at step {step}")
        checkpoint = {"model": {k: v.clone() for k, v in engine.state_dict().items()},
                      "optimizer": copy.deepcopy(optimizer.state_dict()), "engine": engine.engine_state()}
        engine.close()
        step += 1
    print(f"soak: {ITERATIONS} iterations in {time.monotonic() - start:.1f} s, outcomes {outcomes}")
    assert outcomes["torn"] + outcomes["readable"] > ITERATIONS // 2  # most faults were reached
