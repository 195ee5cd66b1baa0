"""Gradient norms: `clip_grad_norm_` is exact and its in-place clip is what the lagged step uses; the late norm
measured on the optimizer thread equals the exact one."""

from __future__ import annotations

import pytest
import torch
from integration_unit_helpers import CPU_WORKERS, lm_batch, tiny_llama, twin

from accelerate_roundpipe import RoundPipeAccelerator, RoundPipeConfig, RoundPipePlugin, wrap_model
from accelerate_roundpipe.integrations.grad_norm import LateGradNorm, gradient_holders


@pytest.mark.parametrize("async_optimizer", [False, True])
def test_clip_returns_the_real_norm_and_the_step_uses_the_clipped_gradients(async_optimizer):
    """Ordering: the clip runs on the caller's thread after `synchronize()` (every gradient final), and the step
    that follows is scheduled after it, so it reads the clipped gradients; a later pass does not disturb them."""
    model = tiny_llama()
    reference = twin(model)
    accelerator = RoundPipeAccelerator(
        roundpipe_plugin=RoundPipePlugin(**{**CPU_WORKERS, "async_optimizer": async_optimizer}))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = accelerator.prepare(model, optimizer)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    model.train()
    batch = lm_batch()
    accelerator.backward(model(**batch).loss)
    norm = accelerator.clip_grad_norm_(model.parameters(), 0.01)
    optimizer.step()
    optimizer.zero_grad()

    reference(**batch).loss.backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01)
    reference_optimizer.step()
    torch.testing.assert_close(norm, expected, atol=1e-5, rtol=1e-5)
    assert norm > 0.01  # the clip was active
    state = accelerator.unwrap_model(model).state_dict()  # synchronizes: the step has run
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(state[name], tensor, atol=1e-6, rtol=0, msg=name)
    accelerator.roundpipe_engine(model).close()


def test_parameters_map_to_the_tensors_holding_gradients():
    model = tiny_llama()
    model.model.norm.weight.requires_grad_(False)
    engine = wrap_model(model, RoundPipeConfig(**CPU_WORKERS))
    holders, engines = gradient_holders(list(model.parameters()), [engine])
    copies = dict(engine.named_parameters())
    assert engines == [engine]
    for (name, _), holder in zip(model.named_parameters(), holders):
        assert holder is copies[name]  # frozen ones map to their compute copy (no gradient there)
    engine.close()


def test_late_norm_equals_the_exact_norm_of_the_previous_step():
    model = tiny_llama()
    reference = twin(model)
    engine = wrap_model(model, RoundPipeConfig(**{**CPU_WORKERS, "async_optimizer": True}))
    optimizer = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-3))
    meter = LateGradNorm(optimizer)
    master = twin(reference)  # staleness 1: the reference model computes with the weights one step behind
    master_optimizer = torch.optim.AdamW(master.parameters(), lr=1e-3)
    expected, measured = [], []
    for step in range(3):
        batch = lm_batch(seed=step)
        engine.forward_backward(**batch)
        meter.before_step(step)
        engine.synchronize()  # step - 1 has finished: its norm is the newest one
        measured.append(meter.newest_norm(step - 1))
        optimizer.step()
        optimizer.zero_grad()

        reference(**batch).loss.backward()
        expected.append(torch.nn.utils.clip_grad_norm_(reference.parameters(), float("inf")).item())
        for p_master, p_model in zip(master.parameters(), reference.parameters()):
            p_master.grad = p_model.grad
        before = {k: v.clone() for k, v in master.state_dict().items()}
        master_optimizer.step()
        master_optimizer.zero_grad()
        reference.zero_grad()
        reference.load_state_dict(before)
    assert measured[0] is None
    assert measured[1:] == pytest.approx(expected[:-1], rel=1e-5)
    engine.synchronize()
    assert meter.newest_norm(5) == pytest.approx(expected[2], rel=1e-5)  # the newest finished step, no wait
    meter.close()
    engine.close()


def test_late_norm_measures_only_the_steps_asked_for():
    """Steps tagged `measure=False` cost nothing on the optimizer thread and are never reported."""
    model = tiny_llama()
    engine = wrap_model(model, RoundPipeConfig(**{**CPU_WORKERS, "async_optimizer": True}))
    optimizer = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-3))
    meter = LateGradNorm(optimizer)
    norms = []
    for step in range(4):
        engine.forward_backward(**lm_batch(seed=step))
        if step == 2:
            engine.synchronize()
            norms.append(torch.nn.utils.clip_grad_norm_(list(engine.parameters()), float("inf")).item())
        meter.before_step(step, measure=step == 2)
        optimizer.step()
        optimizer.zero_grad()
    engine.synchronize()
    assert meter.newest_norm(1) is None  # steps 0 and 1 were not measured
    assert meter.newest_norm(3) == pytest.approx(norms[0], rel=1e-5)  # step 3 was not measured either
    meter.close()
    engine.close()
