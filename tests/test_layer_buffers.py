"""Buffers of the user's layers changed after wrapping reach the devices' copies ([Note: layer buffers followed] in
`runtime/execution/layer_buffers.py`): against the same layers run plainly, on two CPU workers, with the buffer
changed in place, reassigned, and between a forward and its backward (refused)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from accelerate_roundpipe import RoundPipe, RoundPipeConfig


class Biased(nn.Module):
    """A linear layer whose output is shifted by a buffer (as a router's score correction bias is)."""

    def __init__(self, width: int, seed: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.linear = nn.Linear(width, width, dtype=torch.float64)
        with torch.no_grad():
            self.linear.weight.copy_(torch.randn(width, width, generator=generator, dtype=torch.float64) / width)
        self.register_buffer("bias_correction", torch.zeros(width, dtype=torch.float64))

    def forward(self, x):
        return torch.tanh(self.linear(x) + self.bias_correction)


def _layers() -> nn.Sequential:
    return nn.Sequential(*(Biased(8, seed) for seed in range(4)))


def _engine(layers: nn.Sequential) -> RoundPipe:
    return RoundPipe(layers, RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=2, summary=False))


X = torch.randn(6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("change", ["in place", "reassigned"])
def test_a_buffer_changed_after_wrapping_reaches_every_device(change):
    plain = _layers()
    layers = copy.deepcopy(plain)
    engine = _engine(layers)
    try:
        torch.testing.assert_close(engine(X), plain(X), rtol=0, atol=1e-14)  # every copy made with the old value
        for model in (plain, layers):
            for index, layer in enumerate(model):
                value = torch.full((8,), 0.25 * (index + 1), dtype=torch.float64)
                if change == "in place":
                    layer.bias_correction.copy_(value)
                else:
                    layer.bias_correction = value
        for _ in range(2):  # both devices' copies, whichever runs a layer
            torch.testing.assert_close(engine(X), plain(X), rtol=0, atol=1e-14)
        loss = engine.forward_backward(X, loss_fn=lambda out: out.square().sum(), loss_reduction="sum")
        torch.testing.assert_close(loss, plain(X).square().sum(), rtol=1e-14, atol=0)
    finally:
        engine.close()


def test_a_buffer_changed_between_a_forward_and_its_backward_is_refused():
    layers = _layers()
    engine = _engine(layers)
    try:
        out = engine(X)
        layers[2].bias_correction.add_(1.0)
        with pytest.raises(RuntimeError, match="buffer of the model's layers changed between model"):
            out.square().sum().backward()
    finally:
        engine.close()
