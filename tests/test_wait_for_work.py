"""`RoundPipe.wait_for_work()`: every pass and optimizer step queued so far is done, and no look was taken (the
compute copies of buckets stepped on their device are not written, which `synchronize()` does); training goes on
exactly as without it."""

from __future__ import annotations

import time

import torch
from torch import nn

from accelerate_roundpipe import RoundPipe, RoundPipeConfig

from toy_models import batch, tied_model


class SlowAdamW(torch.optim.AdamW):
    """Steps late, so that a wait which returned early would find steps still queued."""

    def step(self, closure=None):
        time.sleep(0.05)
        return super().step(closure)


def _engine() -> tuple[RoundPipe, torch.optim.Optimizer]:
    engine = RoundPipe(tied_model(), RoundPipeConfig(devices=["cpu"], num_microbatches=2, summary=False,
                                                     optimizer_placement="device"))
    return engine, engine.wrap_optimizer(SlowAdamW(engine.parameters(), lr=1e-2))


def _step(engine: RoundPipe, optimizer, seed: int, zero_grad: bool = True) -> None:
    x, mask, y = batch(rows=8, seed=seed)
    engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy)
    optimizer.step()
    if zero_grad:  # its jobs wait for each bucket's step: a wait for them alone would wait for the steps too
        optimizer.zero_grad()


def test_wait_for_work_waits_for_the_steps_without_a_look():
    engine, optimizer = _engine()
    try:
        before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        _step(engine, optimizer, 0)
        _step(engine, optimizer, 1, zero_grad=False)
        engine.wait_for_work()
        assert optimizer.thread.idle
        buckets = engine.host_store.trainable_buckets
        assert all(b.steps.optim == 2 for b in buckets), [b.steps for b in buckets]
        assert all(b.steps.compute < b.steps.optim for b in buckets)  # nothing shown in the compute copies
        assert all(torch.equal(p, before[n]) for n, p in engine.module.named_parameters())
        engine.synchronize()  # the look: now the module shows the steps
        assert all(b.steps.compute == b.steps.optim for b in buckets)
        assert not all(torch.equal(p, before[n]) for n, p in engine.module.named_parameters())
    finally:
        engine.close()


def test_training_through_wait_for_work_equals_training_through_synchronize():
    final = []
    for wait in ("wait_for_work", "synchronize"):
        engine, optimizer = _engine()
        try:
            for seed in range(3):
                _step(engine, optimizer, seed)
                getattr(engine, wait)()
            engine.synchronize()
            final.append({n: p.detach().clone() for n, p in engine.module.named_parameters()})
        finally:
            engine.close()
    assert final[0].keys() == final[1].keys()
    assert all(torch.equal(final[0][n], final[1][n]) for n in final[0])
