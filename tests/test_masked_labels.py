"""A custom `loss_fn` over labels partly `-100` gives the whole batch's loss and gradients, in float64, whatever
the micro-batches hold ([Note: micro-batch loss weights])."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from accelerate_roundpipe import RoundPipe, RoundPipeConfig

from toy_models import assert_close

VOCAB, WIDTH, SEQ, ROWS = 7, 5, 6, 8


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, VOCAB)).double()


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())  # mean over labels != -100


def _batch():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(ROWS, SEQ, WIDTH, generator=gen, dtype=torch.float64)
    y = torch.randint(0, VOCAB, (ROWS, SEQ), generator=gen)
    y[0, 2:] = -100  # micro-batches (2 rows each) hold 10, 11, 0 and 12 valid labels
    y[1, :5] = -100
    y[4:6] = -100  # a micro-batch with every label masked: its own mean is NaN
    return x, y


def _reference(model: nn.Sequential, x, y, loss_fn=token_loss):
    model = copy.deepcopy(model)
    loss = loss_fn(model(x), y)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _assert_engine_matches_whole_batch(devices, loss_fn, **forward_backward_kwargs) -> None:
    """Four micro-batches on `devices`: the loss and every gradient of the whole batch, in float64."""
    x, y = _batch()
    model = _model()
    expected_loss, expected_grads = _reference(model, x, y, loss_fn)
    engine = RoundPipe(model, RoundPipeConfig(devices=devices, num_microbatches=4))
    loss = engine.forward_backward(x, labels=y, loss_fn=loss_fn, **forward_backward_kwargs)
    engine.synchronize()
    assert_close(loss, expected_loss, 1e-12, "loss")
    for name, p in engine.named_parameters():
        assert_close(p.grad, expected_grads[name], 1e-12, name)
    engine.close()


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]])
def test_masked_labels_match_the_whole_batch(devices):
    """Before: micro-batches were weighted by rows (loss off in the third digit, gradients by up to 0.09) and the
    fully masked micro-batch made the loss NaN."""
    _assert_engine_matches_whole_batch(devices, token_loss)


def test_ignore_index_none_weights_by_rows():
    """A loss that averages over rows whatever the labels hold: `ignore_index=None` weights micro-batches by rows."""
    def row_loss(logits, labels):  # every label counts, -100 included (as a large negative target value)
        return ((logits.mean(-1) - labels.to(logits.dtype)) ** 2).mean()

    _assert_engine_matches_whole_batch(["cpu", "cpu"], row_loss, ignore_index=None)


def test_every_label_masked_gives_the_whole_batch_nan():
    x, y = _batch()
    y[:] = -100
    expected_loss, _ = _reference(_model(), x, y)
    engine = RoundPipe(_model(), RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=4))
    loss = engine.forward_backward(x, labels=y, loss_fn=token_loss)
    assert torch.isnan(expected_loss) and torch.isnan(loss)
    engine.close()
