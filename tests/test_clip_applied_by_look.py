"""A look between `clip_grad_norm_` and `step()` applies the clip to the gradients, as torch's clip does at once
([Note: a clip applied by a look] in runtime/stepping/clip.py): `p.grad` read after `synchronize()` is torch's
clipped gradient, and a value clip after a norm clip cuts the scaled gradients, as in torch. Float64, exact and
lagged, host and device placement, through the optimizer and Accelerate's clip paths."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from accelerate_roundpipe import RoundPipe, RoundPipeConfig
from accelerate_roundpipe.integrations.grad_norm import clip_grad_norm, clip_grad_value

from toy_models import batch, run_layers, tied_model

LR, WEIGHT_DECAY, MAX_NORM, VALUE, STEPS = 1e-2, 0.1, 0.5, 0.05, 3
TOL = dict(rtol=1e-12, atol=1e-12)
CASES = [("exact", "host"), ("exact", "device"), ("lagged", "device")]  # device buckets step exactly when lagged


def _batches() -> list[tuple]:
    return [batch(rows=8, seed=10 * step) for step in range(STEPS)]


def _engine(placement: str, lagged: bool) -> tuple[RoundPipe, torch.optim.Optimizer]:
    engine = RoundPipe(tied_model(), RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=2, summary=False,
                                                     optimizer_placement=placement, async_optimizer=lagged))
    return engine, engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=LR, weight_decay=WEIGHT_DECAY))


def _plain(value_clip: bool) -> tuple[list[dict], list[dict]]:
    """Plain PyTorch: each step's clipped gradients and the weights after it."""
    model = tied_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    grads, weights = [], []
    for x, mask, y in _batches():
        nn.functional.cross_entropy(run_layers(model, (x, mask)), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        if value_clip:
            torch.nn.utils.clip_grad_value_(model.parameters(), VALUE)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
        weights.append({n: copy.deepcopy(p.detach()) for n, p in model.named_parameters()})
    return grads, weights


@pytest.mark.parametrize("mode,placement", CASES)
@pytest.mark.parametrize("via", ["optimizer", "accelerate"])
def test_gradients_read_after_a_clip_are_torchs_clipped_gradients(mode, placement, via):
    plain_grads, plain_weights = _plain(value_clip=False)
    engine, optimizer = _engine(placement, mode == "lagged")
    try:
        for step, (x, mask, y) in enumerate(_batches()):
            engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy)
            if via == "optimizer":
                optimizer.clip_grad_norm_(MAX_NORM)
            else:  # RoundPipeAccelerator.clip_grad_norm_'s path
                clip_grad_norm(list(engine.module.parameters()), [engine], MAX_NORM)
            engine.synchronize()
            for name, p in engine.named_parameters():
                torch.testing.assert_close(p.grad, plain_grads[step][name], **TOL,
                                           msg=lambda m, s=step, n=name: f"step {s + 1}, {n}.grad: {m}")
            optimizer.step()
            optimizer.zero_grad()
        engine.synchronize()
        for name, p in engine.named_parameters():  # the clip applied once: the weights are torch's
            torch.testing.assert_close(p.detach(), plain_weights[-1][name], **TOL)
    finally:
        engine.close()


@pytest.mark.parametrize("mode,placement", CASES)
def test_a_value_clip_after_a_norm_clip_cuts_the_scaled_gradients(mode, placement):
    """Accelerate's `clip_grad_norm_` then `clip_grad_value_` (the synchronous path), as torch orders them."""
    _, plain_weights = _plain(value_clip=True)
    engine, optimizer = _engine(placement, mode == "lagged")
    try:
        for step, (x, mask, y) in enumerate(_batches()):
            engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy)
            params = list(engine.module.parameters())
            clip_grad_norm(params, [engine], MAX_NORM)
            clip_grad_value(params, [engine], VALUE)
            optimizer.step()
            optimizer.zero_grad()
            weights = engine.state_dict()
            for name, expected in plain_weights[step].items():
                torch.testing.assert_close(weights[name], expected, **TOL,
                                           msg=lambda m, s=step, n=name: f"step {s + 1}, {n}: {m}")
    finally:
        engine.close()
