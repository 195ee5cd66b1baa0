"""[Note: weight edits followed] (`runtime/state/weight_edits.py`): parameters changed in place after wrapping (a
mask, an init, `load_state_dict` on the model) are what the next pass and step use, in every tier of optimizer
state, as in plain torch; a loop that changes nothing follows nothing. Float64 on two CPU workers."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from accelerate_roundpipe import RoundPipe, RoundPipeConfig

WIDTH = 8


def _layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH, dtype=torch.float64), nn.Tanh())
                           for _ in range(4)))


def _batch(step: int) -> torch.Tensor:
    return torch.randn(6, WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(step))


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().sum()


def _adamw(params) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


MASK = (torch.arange(WIDTH * WIDTH).reshape(WIDTH, WIDTH) % 3 != 0).double()


def _edit(model: nn.Module, step: int) -> None:
    """What a user's loop might do between steps: prune one weight, re-initialise a bias, load another layer."""
    with torch.no_grad():
        if step == 0:
            model[1][0].weight.mul_(MASK)
        if step == 1:
            nn.init.constant_(model[2][0].bias, 0.25)
        if step == 2:
            model[3].load_state_dict({"0.weight": torch.eye(WIDTH, dtype=torch.float64),
                                      "0.bias": torch.zeros(WIDTH, dtype=torch.float64)})


TIERS = {
    "host": dict(optimizer_placement="host"),
    "device": dict(optimizer_placement="device"),
    "disk": dict(optimizer_placement="host", host_memory_budget=1e-9),
}


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# Two CPU workers, and (where there is a GPU) two workers on it: its `device` tier keeps the state on the GPU.
WORKERS = [pytest.param(["cpu", "cpu"], id="cpu"),
           pytest.param(["cuda:0", "cuda:0"], id="cuda", marks=[pytest.mark.gpu, GPU])]


@pytest.mark.parametrize("tier", sorted(TIERS))
@pytest.mark.parametrize("where", ["after the step", "between backward and step"])
@pytest.mark.parametrize("devices", WORKERS)
def test_an_edit_after_wrapping_is_what_the_next_pass_and_step_use(tier, where, devices, tmp_path):
    plain = _layers()
    layers = copy.deepcopy(plain)
    settings = dict(TIERS[tier])
    if "host_memory_budget" in settings:
        settings["offload_dir"] = str(tmp_path / "offload")
    engine = RoundPipe(layers, RoundPipeConfig(devices=devices, num_microbatches=2, summary=False, **settings))
    try:
        plain_opt = _adamw(plain.parameters())
        optimizer = engine.wrap_optimizer(_adamw(engine.parameters()))
        for step in range(4):
            x = _batch(step)
            _loss(plain(x)).backward()
            engine.forward_backward(x, loss_fn=_loss, loss_reduction="sum")
            if where == "between backward and step":
                _edit(plain, step)
                engine.synchronize()  # the weights shown are the current ones once the backward is done
                _edit(layers, step)
            plain_opt.step()
            optimizer.step()
            plain_opt.zero_grad()
            optimizer.zero_grad()
            if where == "after the step":
                _edit(plain, step)
                engine.synchronize()  # a look first: the edit reads the weights (the mask multiplies them)
                _edit(layers, step)
        loss = engine.forward_backward(_batch(9), loss_fn=_loss, loss_reduction="sum")
        torch.testing.assert_close(loss, _loss(plain(_batch(9))), rtol=1e-9, atol=0)
        engine.synchronize()
        for name, p in plain.named_parameters():
            torch.testing.assert_close(layers.get_parameter(name), p, rtol=1e-9, atol=1e-12, msg=name)
        assert engine.weight_edits_followed >= 3
    finally:
        engine.close()


def test_a_loop_that_edits_nothing_follows_nothing():
    engine = RoundPipe(_layers(), RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=2, summary=False))
    try:
        optimizer = engine.wrap_optimizer(_adamw(engine.parameters()))
        for step in range(3):
            engine.forward_backward(_batch(step), loss_fn=_loss, loss_reduction="sum")
            optimizer.clip_grad_norm_(1.0)
            optimizer.step()
            optimizer.zero_grad()
            engine.synchronize()
            engine.state_dict()
        assert engine.weight_edits_followed == 0
    finally:
        engine.close()
