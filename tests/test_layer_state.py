"""A layer may not change its own state in forward ([Note: stateless layers]): buffers changed in place, buffers
reassigned and tensors set as attributes all raise `StatefulLayerError`, naming the layer and what changed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from accelerate_roundpipe import RoundPipe, RoundPipeConfig
from accelerate_roundpipe.runtime.execution.layer_copy import StatefulLayerError


class CountsCalls(nn.Module):
    """Reassigns its buffer: the change lands on a new tensor (before: never detected)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.count = self.count + 1
        return x


class CachesInput(nn.Module):
    """Keeps a tensor as a plain attribute (before: never detected)."""

    def forward(self, x):
        self.cache = x.detach()
        return x


class FillsPresetSlot(nn.Module):
    """Sets a tensor into an attribute that held None from __init__ (the attribute count does not change)."""

    def __init__(self) -> None:
        super().__init__()
        self.last = None

    def forward(self, x):
        self.last = x.detach()
        return x


class CachesOnThirdCall(nn.Module):
    """Stateless for two runs (counting them in a plain int, which is no tensor state), then caches a tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 3:
            self.cache = x.detach()
        return x


class FoldsOnEval(nn.Module):
    """Makes a tensor in its own train(False) (the engine's mode switch, between runs, not its forward), bumps an
    int every run (a replacement: the full check runs each time) and caches its input on its third run."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def train(self, mode: bool = True):
        super().train(mode)
        if not mode:
            self.folded = torch.ones(4)
        return self

    def forward(self, x):
        self.calls += 1
        if self.calls == 3:
            self.cache = x.detach()
        return x


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x):
        self.scale = self.scale * 0.5
        return x * self.scale


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()

    def forward(self, x):
        return self.inner(x)


class Harmless(nn.Module):
    """Reads its buffer and an attribute set in __init__: stateless."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("offset", torch.full((4,), 0.1))
        self.factor = torch.tensor(2.0)

    def forward(self, x):
        return x * self.factor + self.offset


def _engine(layer: nn.Module, devices=("cpu", "cpu")) -> RoundPipe:
    torch.manual_seed(0)
    return RoundPipe(nn.Sequential(nn.Linear(4, 4), layer, nn.Linear(4, 3)),
                     RoundPipeConfig(devices=list(devices), num_microbatches=2))


def _train(engine: RoundPipe) -> torch.Tensor:
    return engine.forward_backward(torch.randn(4, 4), labels=torch.randint(0, 3, (4,)),
                                   loss_fn=nn.functional.cross_entropy)


@pytest.mark.parametrize("layer, what", [
    (CountsCalls(), r"buffer 'count' reassigned"),
    (CachesInput(), r"attribute 'cache' set"),
    (Nested(), r"buffer 'inner\.scale' reassigned"),
    (nn.BatchNorm1d(4), r"buffer 'num_batches_tracked' changed in place"),
    (FillsPresetSlot(), r"attribute 'last' set"),
])
def test_layer_state_changed_in_forward_is_refused(layer, what):
    engine = _engine(layer)
    with pytest.raises(StatefulLayerError, match=rf"layer 1 \({type(layer).__name__}\) changed its state in forward: "
                                                 rf".*{what}"):
        _train(engine)
    engine.close()


def test_forward_only_passes_check_too():
    engine = _engine(CountsCalls())
    with torch.no_grad(), pytest.raises(StatefulLayerError, match="buffer 'count' reassigned"):
        engine(torch.randn(4, 4))
    engine.close()


def test_reading_buffers_and_attributes_is_fine():
    engine = _engine(Harmless())
    loss = _train(engine)
    engine.synchronize()
    assert torch.isfinite(loss)
    engine.close()


def test_a_change_after_clean_runs_is_caught_and_plain_attributes_are_no_state():
    """The cheap per-run snapshot stands for the full check: an int attribute bumped every run is no tensor state
    (accepted), and a tensor cached on a later run is refused then."""
    engine = RoundPipe(nn.Sequential(nn.Linear(4, 4), CachesOnThirdCall(), nn.Linear(4, 3)),
                       RoundPipeConfig(devices=["cpu"], num_microbatches=1))
    try:
        with torch.no_grad():
            engine(torch.randn(4, 4))
            engine(torch.randn(4, 4))
            with pytest.raises(StatefulLayerError, match=r"layer 1 \(CachesOnThirdCall\).*attribute 'cache' set"):
                engine(torch.randn(4, 4))
    finally:
        engine.close()


def test_a_tensor_made_by_a_mode_switch_is_not_blamed_on_the_next_forward():
    """A tensor a layer makes in its own train()/eval() is made between runs: the runs after the switch are checked
    from the state after it (no error blaming the forward), and a tensor a later forward caches is still refused."""
    engine = RoundPipe(nn.Sequential(nn.Linear(4, 4), FoldsOnEval(), nn.Linear(4, 3)),
                       RoundPipeConfig(devices=["cpu"], num_microbatches=1))
    try:
        with torch.no_grad():
            engine(torch.randn(4, 4))  # training mode: the layer's copy is made without `folded`
            engine.eval()
            assert torch.isfinite(engine(torch.randn(4, 4))).all()  # its copy's train(False) made `folded`
            with pytest.raises(StatefulLayerError,
                               match=r"layer 1 \(FoldsOnEval\) changed its state in forward: attribute 'cache' set\. "):
                engine(torch.randn(4, 4))
    finally:
        engine.close()
