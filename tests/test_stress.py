"""Random delays in workers, transfers, commits and the optimizer thread change nothing, bit for bit."""

from __future__ import annotations

import copy
import random
import threading
import time

import pytest
import torch
from torch import nn

from accelerate_roundpipe import RoundPipe, RoundPipeConfig
from accelerate_roundpipe.runtime.common import faults

from toy_models import batch, tied_model

NUM_ITERATIONS = 50


def train(model, async_optimizer: bool):
    engine = RoundPipe(copy.deepcopy(model), RoundPipeConfig(devices=["cpu"] * 3, num_microbatches=5, seed=3,
                                                             microbatches_per_round=3,
                                                             async_optimizer=async_optimizer))
    optimizer = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-2))
    losses = []
    for k in range(NUM_ITERATIONS):
        x, mask, y = batch(rows=7, seed=k)
        losses.append(engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy))
        optimizer.step()
        optimizer.zero_grad()
        if k % 17 == 16:
            engine.synchronize()
    engine.synchronize()
    weights = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    state = copy.deepcopy(optimizer.state_dict())
    engine.close()
    return torch.stack(losses), weights, state


@pytest.mark.parametrize("async_optimizer", [True, False])
def test_injected_delays_do_not_change_results(async_optimizer):
    model = tied_model(dropout=0.3)
    calm = train(model, async_optimizer)
    rng = random.Random(0)
    lock = threading.Lock()
    seen = set()

    def jitter(point: str) -> None:
        with lock:
            seen.add(point)
            delay = rng.random() * 0.002 if rng.random() < 0.5 else 0.0
        time.sleep(delay)

    with faults.injected(jitter):
        stressed = train(model, async_optimizer)
    assert seen >= {"worker.task", "transfer.upload", "transfer.download", "commit", "optimizer.step",
                    "optimizer.writeback"}
    assert torch.equal(calm[0], stressed[0])
    for name, value in calm[1].items():
        assert torch.equal(value, stressed[1][name]), name
    for key, value in calm[2]["state"].items():
        for field, tensor in value.items():
            assert torch.equal(tensor, stressed[2]["state"][key][field]), (key, field)
    assert not torch.equal(calm[1]["0.linear.weight"], model[0].linear.weight), "training moved the weights"
