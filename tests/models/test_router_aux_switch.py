"""[Note: router aux loss fixed at wrap] (`models/causal_lm.py`): HF decides at every forward whether its loss
includes the router aux loss (the call's `output_router_logits`, else the config's) and with which weight (the
model's `router_aux_loss_coef`); the split decides once, in `wrap_model`. A call or setting that asks otherwise is
refused with what to change, instead of a loss other than HF's; unchanged settings give HF's loss."""

from __future__ import annotations

import copy

import pytest
import torch

from accelerate_roundpipe import RoundPipeConfig, wrap_model

from split_helpers import assert_close, build_model, gradients, make_batch, switch_aux_loss

pytest.importorskip("transformers")


@pytest.fixture
def wrapped():
    model = build_model("qwen3_moe", output_router_logits=True, router_aux_loss_coef=0.5).eval()
    reference = copy.deepcopy(model)
    engine = wrap_model(model, RoundPipeConfig(devices=["cpu"], num_microbatches=1))
    yield engine, model, reference
    engine.close()


def _loss(model, batch, **kwargs):
    with torch.no_grad():
        return model(**batch, **kwargs).loss


def test_unchanged_settings_give_hfs_loss_with_the_aux_loss(wrapped):
    _, model, reference = wrapped
    batch = make_batch("left")
    assert_close(_loss(model, batch), _loss(reference, batch), "loss with the aux loss", rtol=1e-6)  # HF: fp32 CE
    assert_close(_loss(model, batch, output_router_logits=None), _loss(reference, batch), "the config's", rtol=1e-6)


def test_a_call_without_router_logits_is_refused_not_given_the_aux_loss(wrapped):
    _, model, reference = wrapped
    batch = make_batch("left")
    # HF leaves the aux loss out of this call's loss (before the check the engine's loss had it: 5.159 vs 4.156).
    assert float(_loss(reference, batch, output_router_logits=False)) < float(_loss(reference, batch)) - 0.1
    with pytest.raises(ValueError, match=r"this call passes `output_router_logits=False`.*before wrap_model"):
        _loss(model, batch, output_router_logits=False)
    with pytest.raises(ValueError, match=r"returns no router logits or `aux_loss`.*Leave `output_router_logits` unset"):
        _loss(model, batch, output_router_logits=True)


@pytest.mark.parametrize("change", ["output_router_logits", "router_aux_loss_coef"])
def test_settings_changed_after_wrapping_are_refused(wrapped, change):
    engine, model, reference = wrapped
    batch = make_batch("left")
    before = float(_loss(reference, batch))
    if change == "output_router_logits":
        model.config.output_router_logits = reference.config.output_router_logits = False
        message = r"config.output_router_logits is False now.*before wrap_model"
    else:
        model.router_aux_loss_coef = reference.router_aux_loss_coef = 2.0
        message = r"router_aux_loss_coef is 2.0 now, but it was 0.5 when the model was wrapped"
    assert float(_loss(reference, batch)) != pytest.approx(before)  # HF's loss follows the change
    with pytest.raises(ValueError, match=message):
        _loss(model, batch)  # eval
    model.train()
    with pytest.raises(ValueError, match=message):
        model(**batch)  # the fused training pass
    with pytest.raises(ValueError, match=message):
        engine.forward_backward(**batch)


@pytest.mark.parametrize("num_microbatches", [1, 3])
def test_aux_loss_is_returned_without_labels_for_a_loss_of_ones_own(num_microbatches):
    """`model(input_ids, attention_mask)` of an MoE model with `output_router_logits`: HF returns `aux_loss` (the
    whole batch's, before the coefficient) beside the logits, for a loss of the caller's own; the engine returned
    no `aux_loss` (AttributeError). Its value and gradient are HF's, in float64, for any micro-batch count."""
    model = build_model("qwen3_moe", output_router_logits=True, router_aux_loss_coef=0.5)
    reference = copy.deepcopy(model)
    batch = make_batch("left")
    del batch["labels"]
    outputs = reference(**batch)
    expected_aux = switch_aux_loss(outputs.router_logits, model.num_experts, model.num_experts_per_tok,
                                   batch["attention_mask"])  # HF's own is float32
    (outputs.logits.square().mean() + expected_aux).backward()
    engine = wrap_model(model, RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=num_microbatches))
    try:
        got = model(**batch)
        assert got.loss is None
        assert_close(got.aux_loss.detach(), expected_aux.detach(), "aux_loss")
        (got.logits.square().mean() + got.aux_loss).backward()
        engine.synchronize()
        expected = gradients(reference)
        for name, p in engine.named_parameters():
            assert_close(p.grad, expected[name], f"grad of {name}")
    finally:
        engine.close()
