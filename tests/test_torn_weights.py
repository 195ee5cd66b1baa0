"""After a failure during an optimizer step the model is at one step, or refuses to be read
([Note: torn weights]): `engine.module`, the user's `module.state_dict()` and the engine's state dict raise
`TornWeightsError` naming which layers hold which step."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from accelerate_roundpipe import RoundPipe, RoundPipeConfig
from accelerate_roundpipe.runtime.common import faults
from accelerate_roundpipe.runtime.state.torn import TornWeightsError

from toy_models import assert_close

LR = 0.1


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(),
                         nn.Linear(4, 3)).double()


def _batch(seed: int):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(6, 4, generator=gen, dtype=torch.float64), torch.randint(0, 3, (6,), generator=gen)


def _reference_after(model: nn.Sequential, steps: int) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(steps):
        x, y = _batch(step)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


def _two_steps(point: str, call: int):
    """Sync-mode training of two steps with a fault at the `call`-th `point` (4 buckets: calls 5-8 are step 2)."""
    module = _model()
    engine = RoundPipe(module, RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=2, async_optimizer=False))
    optimizer = engine.wrap_optimizer(torch.optim.SGD(engine.parameters(), lr=LR))
    fault = faults.raise_at(point, call, RuntimeError)
    with faults.injected(fault), pytest.raises(RuntimeError, match="injected fault"):
        for step in range(2):
            x, y = _batch(step)
            engine.forward_backward(x, labels=y, loss_fn=nn.functional.cross_entropy)
            optimizer.step()
            optimizer.zero_grad()
        engine.synchronize()
    return engine, module


def test_a_step_torn_by_a_failure_refuses_to_be_read():
    """Before: the layers held different steps and `engine.module` could still be read and saved. (Which layers
    hold which step depends on the order the exact step takes the buckets in: [Note: exact step order].)"""
    engine, module = _two_steps("optimizer.step", 7)  # the third bucket's step of step 2
    with pytest.raises(TornWeightsError, match=r"hold step 1; .* step 2"):
        _ = engine.module
    with pytest.raises(TornWeightsError, match="resume from your last checkpoint"):
        module.state_dict()  # the user's own module: save_pretrained and torch.save(state_dict) go through it
    engine.close()
    with pytest.raises(TornWeightsError):
        module.state_dict()


@pytest.mark.parametrize("point, call, steps", [
    ("optimizer.step", 5, 1),  # before the first bucket of step 2 changed anything
    ("optimizer.writeback", 2, 2),  # while synchronize() wrote step 2 into the compute copies
])
def test_a_failure_that_leaves_one_step_keeps_the_model_readable(point, call, steps):
    """Every layer reached the same step: the model is the model after that step, exactly (the exact step's
    optimizer copies are written into the module when it is read: [Note: exact step without write-back])."""
    engine, module = _two_steps(point, call)
    expected = _reference_after(_model(), steps)
    for name, value in engine.module.state_dict().items():
        assert_close(value, expected[name], 1e-12, name)
    engine.close()
    assert module.state_dict().keys() == expected.keys()


def test_a_closed_healthy_engine_leaves_no_guard_on_the_module():
    module = _model()
    engine = RoundPipe(module, RoundPipeConfig(devices=["cpu"]))
    engine.close()
    assert not module._state_dict_pre_hooks
