"""[Note: deferred gradient commit]: a fused pass whose loss's backward decides the gradient scale."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from torch import nn

from accelerate_roundpipe import RoundPipe, RoundPipeConfig
from accelerate_roundpipe.runtime.common import faults

from toy_models import assert_close, batch, reference_loss_and_grads, tied_model

RTOL = 1e-10


def make_engine(model, **config):
    return RoundPipe(copy.deepcopy(model), RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=3, **config))


def fb(engine, data):
    x, mask, y = data
    return engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy, deferred=True)


def grads_of(engine):
    engine.synchronize()
    return {n: (p.grad.clone() if p.grad is not None else None) for n, p in engine.named_parameters()}


@pytest.mark.parametrize("expected", [1.0, 0.5])
def test_backward_scale_is_exact_whatever_was_expected(expected):
    model = tied_model()
    data = batch(rows=7)
    ref_loss, ref = reference_loss_and_grads(model, *data)
    engine = make_engine(model)
    engine.expect_grad_scale(expected)
    loss = fb(engine, data)
    assert loss.requires_grad
    assert_close(loss.detach(), ref_loss, RTOL, "loss")
    (loss * 0.5).backward()
    for name, grad in grads_of(engine).items():
        assert_close(grad, 0.5 * ref[name], RTOL, name)
    engine.close()


def test_any_function_of_the_loss():
    model = tied_model()
    data = batch(rows=7)
    ref_loss, ref = reference_loss_and_grads(model, *data)
    engine = make_engine(model)
    loss = fb(engine, data)
    (loss ** 2 + 3).backward()
    for name, grad in grads_of(engine).items():
        assert_close(grad, 2 * ref_loss * ref[name], RTOL, name)
    engine.close()


def two_batches_and_their_grads(model):
    first, second = batch(rows=7, seed=1), batch(rows=5, seed=2)
    return first, second, reference_loss_and_grads(model, *first)[1], reference_loss_and_grads(model, *second)[1]


def test_accumulation_uses_the_pending_buffer():
    model = tied_model()
    first, second, g1, g2 = two_batches_and_their_grads(model)
    engine = make_engine(model)
    engine.expect_grad_scale(0.5)
    (fb(engine, first) / 2).backward()
    (fb(engine, second) * 0.25).backward()  # differs from the expected 0.5: still exact
    for name, grad in grads_of(engine).items():
        assert_close(grad, 0.5 * g1[name] + 0.25 * g2[name], RTOL, name)
    engine.close()


def _accumulated_grads(model, ratio):
    first, second, _, _ = two_batches_and_their_grads(model)
    engine = make_engine(model)
    engine.expect_grad_scale(0.5)
    (fb(engine, first) * 0.5).backward()
    for _ in range(3):  # the later calls of an accumulation commit into buckets that hold gradients
        (fb(engine, second) * ratio).backward()
    grads = grads_of(engine)
    assert all(b.pending is None for b in engine._store.trainable_buckets)  # given back at resolution
    engine.close()
    return grads


@pytest.mark.parametrize("ratio", [0.5, 0.25], ids=["as expected", "another scale"])
def test_commits_after_the_resolution_add_at_once_as_the_held_ones_would(ratio, monkeypatch):
    """[Note: deferred gradient commit]: a commit that comes after the loss's backward adds with c/c0 at once;
    bitwise what holding it apart gives (no bucket allowed to: `single_commits` empty), and no pending buffer
    outlives its pass."""
    from accelerate_roundpipe.runtime.engine import engine as engine_module
    from accelerate_roundpipe.runtime.state.bucket import Bucket

    model = tied_model()
    direct_adds = []
    real_add_scaled = Bucket.add_scaled

    def add_scaled(self, *args):
        direct_adds.append(self.index)
        return real_add_scaled(self, *args)

    monkeypatch.setattr(Bucket, "add_scaled", add_scaled)
    added_at_once = _accumulated_grads(model, ratio)
    assert direct_adds, "no commit came after its pass's resolution"
    direct_adds.clear()
    monkeypatch.setattr(engine_module, "single_commit_buckets", lambda tasks, store: frozenset())
    held_apart = _accumulated_grads(model, ratio)
    assert not direct_adds
    for name, grad in held_apart.items():
        assert torch.equal(added_at_once[name], grad), name


def test_never_committed_gradients_are_dropped():
    model = tied_model()
    first, second, g1, g2 = two_batches_and_their_grads(model)
    engine = make_engine(model)
    fb(engine, first)  # never back-propagated: dropped by the next pass (the buffer was empty: owned path)
    fb(engine, second).backward()
    for name, grad in grads_of(engine).items():
        assert_close(grad, g2[name], RTOL, name)
    fb(engine, first)  # dropped again, this time from the pending buffer (grads already held)
    fb(engine, first).backward()
    for name, grad in grads_of(engine).items():
        assert_close(grad, g1[name] + g2[name], RTOL, name)
    engine.close()


def test_step_drops_an_uncommitted_pass_and_double_backward_fails():
    model = tied_model()
    engine = make_engine(model)
    optimizer = engine.wrap_optimizer(torch.optim.SGD(engine.parameters(), lr=0.1))
    before = {n: p.detach().clone() for n, p in engine.named_parameters()}
    loss = fb(engine, batch(rows=6))
    optimizer.step()  # the pass was never committed: no gradients, nothing moves
    assert all(torch.equal(before[n], p) for n, p in engine.named_parameters())
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()
    loss = fb(engine, batch(rows=6))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()
    engine.close()


def test_resolution_lets_top_layers_step_before_the_bottom_gradients_land():
    """Resolution jobs run in gradient-final order (top first) on their serial thread: the exact step of a top bucket
    then runs while the bottom bucket's commit is still delayed. Queued bottom-first, the first job waited for the
    backward's very end and held every step behind it."""
    model = tied_model()
    engine = RoundPipe(copy.deepcopy(model), RoundPipeConfig(devices=["cpu"], num_microbatches=1,
                                                             async_optimizer=False))
    optimizer = engine.wrap_optimizer(torch.optim.SGD(engine.parameters(), lr=0.1))
    events, commits = [], []
    last_commit = len(engine._store.trainable_buckets)

    def hook(point: str) -> None:
        if point == "commit":
            commits.append(point)
            if len(commits) == last_commit:  # the bottom bucket's gradients: the backward's last commit
                time.sleep(0.3)
                events.append("bottom committed")
        elif point == "optimizer.step":
            events.append("step")

    with faults.injected(hook):
        fb(engine, batch(rows=4)).backward()
        optimizer.step()
        engine.synchronize()
    assert "step" in events[:events.index("bottom committed")]
    engine.close()
