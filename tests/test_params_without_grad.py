"""[Note: parameters without a gradient] (`runtime/state/bucket.py`): a trainable parameter no loss reaches keeps
`.grad` None and is not stepped, as in plain torch, and `p.grad = None` / `p.grad = t` on the engine's optimizer
copies do what they do in plain torch. Float64 on two CPU workers against the same layers and optimizer run plainly,
through the engine API and through the Accelerate loop."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

from accelerate_roundpipe import RoundPipe, RoundPipeConfig


class Gated(nn.Module):
    """A layer with a branch taken only for inputs whose first feature is positive (an unused module otherwise:
    decided by the data, which a recomputation sees again), and a LoRA-like pair whose `up` starts at zero (so
    `down` is reached but gets an exactly zero gradient at first)."""

    def __init__(self, width: int, seed: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.main = nn.Linear(width, width, dtype=torch.float64)
        self.side = nn.Linear(width, width, dtype=torch.float64)
        self.down = nn.Linear(width, 2, bias=False, dtype=torch.float64)
        self.up = nn.Linear(2, width, bias=False, dtype=torch.float64)
        with torch.no_grad():
            for linear in (self.main, self.side, self.down):
                linear.weight.copy_(torch.randn(linear.weight.shape, generator=generator, dtype=torch.float64) / width)
            self.up.weight.zero_()

    def forward(self, x):
        h = self.main(x) + self.up(self.down(x))
        if bool(x[0, 0] > 0):
            h = h + self.side(x)
        return torch.cat([x[:, :1], torch.tanh(h[:, 1:])], dim=1)  # the first feature passed on, as the flag


def _layers() -> nn.Sequential:
    return nn.Sequential(*(Gated(8, seed) for seed in range(4)))


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# Two CPU workers, and (where there is a GPU) two workers on it, whose preset `.grad` tensors live on the device.
WORKERS = [pytest.param(["cpu", "cpu"], id="cpu"),
           pytest.param(["cuda:0", "cuda:0"], id="cuda", marks=[pytest.mark.gpu, GPU])]


def _engine(layers: nn.Sequential, devices: list[str] | None = None, **settings) -> RoundPipe:
    return RoundPipe(layers, RoundPipeConfig(devices=devices or ["cpu", "cpu"], num_microbatches=2, summary=False,
                                             **settings))


def _batch(step: int, use_side: bool = True) -> torch.Tensor:
    """Six rows; the first feature of every row says whether the layers take their side branch."""
    x = torch.randn(6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(100 + step))
    x[:, 0] = 1.0 if use_side else -1.0
    return x


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().sum()


def _adamw(params) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


@contextlib.contextmanager
def _side_by_side(devices: list[str] | None = None, **settings):
    """The same layers run plainly and on the engine, each with AdamW: (plain, layers, engine, plain's optimizer,
    the engine's); the engine closed afterwards."""
    plain = _layers()
    layers = copy.deepcopy(plain)
    engine = _engine(layers, devices, **settings)
    try:
        yield plain, layers, engine, _adamw(plain.parameters()), engine.wrap_optimizer(_adamw(engine.parameters()))
    finally:
        engine.close()


def _assert_same_weights(layers: nn.Module, plain: nn.Module) -> None:
    for name, theirs in plain.named_parameters():
        torch.testing.assert_close(layers.get_parameter(name), theirs, rtol=1e-9, atol=1e-12, msg=name)


SIDE_USE = [False, True, False, False]  # the side branch: unused, then used once, then unused again


@pytest.mark.parametrize("settings", [{}, {"backward_stages": [1, 1, 1, 1]}, {"recompute": "layer"}],
                         ids=["exact", "a layer a stage", "recompute layer"])
@pytest.mark.parametrize("devices", WORKERS)
def test_an_unreached_parameter_is_not_stepped(settings, devices):
    with _side_by_side(devices, **settings) as (plain, layers, engine, plain_opt, optimizer):
        for step, use_side in enumerate(SIDE_USE):
            x = _batch(step, use_side)
            plain_opt.zero_grad()
            _loss(plain(x)).backward()
            plain_opt.step()
            engine.forward_backward(x, loss_fn=_loss, loss_reduction="sum")
            if step == 0:
                engine.synchronize()
                side = [p for n, p in engine.named_parameters() if ".side." in n]
                assert side and all(p.grad is None for p in side)  # no loss reached them: None, as in plain torch
            optimizer.step()
            optimizer.zero_grad()
        engine.synchronize()
        _assert_same_weights(layers, plain)
        stepped_side = [p for n, p in plain.named_parameters() if ".side." in n]
        assert all(plain_opt.state[p]["step"] == 1 for p in stepped_side)  # the plain run stepped them once


@pytest.mark.parametrize("settings", [{"async_optimizer": True}, {"optimizer_placement": "host"}],
                         ids=["lagged", "host"])
def test_a_parameter_never_reached_keeps_its_value_and_has_no_state(settings):
    layers = _layers()
    before = {n: p.detach().clone() for n, p in layers.named_parameters()}
    engine = _engine(layers, **settings)
    try:
        optimizer = engine.wrap_optimizer(_adamw(engine.parameters()))
        for step in range(3):
            engine.forward_backward(_batch(step, use_side=False), loss_fn=_loss, loss_reduction="sum")
            optimizer.step()
            optimizer.zero_grad()
        engine.synchronize()
        for name, p in layers.named_parameters():
            if ".side." in name:  # weight decay alone would have moved them by lr * 0.1 a step
                assert torch.equal(p, before[name]), name
            else:
                assert not torch.equal(p, before[name]), name
        copies = dict(engine.named_parameters())
        assert not any(copies[n] in optimizer.state for n in copies if ".side." in n)
        assert all(copies[n] in optimizer.state for n in copies if ".side." not in n)
    finally:
        engine.close()


@pytest.mark.parametrize("devices", WORKERS)
def test_setting_grad_to_none_forgets_it_and_setting_a_tensor_replaces_it(devices):
    with _side_by_side(devices) as (plain, layers, engine, plain_opt, optimizer):
        ours = dict(engine.named_parameters())
        theirs = dict(plain.named_parameters())
        for step in range(3):
            x = _batch(step)
            _loss(plain(x)).backward()
            engine.forward_backward(x, loss_fn=_loss, loss_reduction="sum")
            engine.synchronize()
            if step == 0:  # a whole layer cleared by hand: both skip it in this step
                for name in ours:
                    if name.startswith("1."):
                        ours[name].grad = None
                        theirs[name].grad = None
            if step == 1:  # one gradient replaced, another cleared
                for params in (ours, theirs):
                    weight = params["2.main.weight"]  # a gradient lives where its parameter does, as torch asks
                    weight.grad = torch.full((8, 8), 0.5, dtype=torch.float64, device=weight.device)
                    params["3.main.bias"].grad = None
            plain_opt.step()
            optimizer.step()
            # the usual clearing by hand instead of zero_grad(): every gradient forgotten
            for params in (ours, theirs):
                for p in params.values():
                    p.grad = None
        engine.synchronize()
        _assert_same_weights(layers, plain)
        # `p.grad = None` for every parameter forgets every gradient and gives every host buffer back, as zero_grad()
        # would (a bucket stepped on a GPU keeps its gradient buffer there: the placement counted it)
        buckets = engine._store.trainable_buckets
        assert not any(b.grad_valid for b in buckets)
        assert all(b.grad is None for b in buckets if b.tier.gives_back_cleared_grads)


def test_clearing_by_hand_between_accumulated_backwards():
    """`p.grad = None` after one backward and before the next: the next step sees only the second backward."""
    with _side_by_side() as (plain, layers, engine, plain_opt, optimizer):
        for model, step_with in ((plain, plain_opt), (engine, optimizer)):
            params = list(model.parameters())
            for step in range(2):
                for part in range(2):
                    x = _batch(10 * step + part)
                    if model is engine:
                        engine.forward_backward(x, loss_fn=_loss, loss_reduction="sum")
                        engine.synchronize()
                    else:
                        _loss(plain(x)).backward()
                    if part == 0:
                        for p in params:
                            p.grad = None
                step_with.step()
                step_with.zero_grad()
        engine.synchronize()
        _assert_same_weights(layers, plain)


def test_an_in_place_edit_of_a_gradient_is_clipped_by_its_new_norm():
    """A write into `p.grad` (here `clip_grad_value_` over the optimizer copies) makes the norm the engine measured
    on the device stale: the clip that follows measures again."""
    with _side_by_side() as (plain, layers, engine, plain_opt, optimizer):
        for step in range(2):
            x = _batch(step)
            _loss(plain(x)).backward()
            torch.nn.utils.clip_grad_value_(plain.parameters(), 0.05)
            plain_norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.1)
            plain_opt.step()
            plain_opt.zero_grad()
            engine.forward_backward(x, loss_fn=_loss, loss_reduction="sum")
            engine.synchronize()
            torch.nn.utils.clip_grad_value_(engine.parameters(), 0.05)
            norm = optimizer.clip_grad_norm_(0.1)
            optimizer.step()
            optimizer.zero_grad()
            torch.testing.assert_close(torch.as_tensor(float(norm), dtype=torch.float64), plain_norm, rtol=1e-9,
                                       atol=0)
        engine.synchronize()
        _assert_same_weights(layers, plain)
