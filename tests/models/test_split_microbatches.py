"""Split == whole: the sum of micro-batch losses (the engine's loss_reduction="sum") is the batch loss."""

import pytest
import torch

from accelerate_roundpipe.models import split_causal_lm

from split_helpers import (
    FLOAT32_NORM_FAMILIES,
    MOE_FAMILIES,
    assert_close,
    assert_same_gradients,
    available_families,
    build_model,
    gradients,
    make_batch,
    reference_loss,
    run_layers,
    split_rows,
    switch_aux_loss,
)

SIZES = ([2, 1], [1, 1, 1])


def _whole_and_summed(model, batch, sizes):
    split = split_causal_lm(model)
    inputs = split.prepare_inputs(**batch)

    whole = run_layers(split.layers, inputs)
    whole.backward()
    whole_grads = gradients(model)
    model.zero_grad()

    summed = sum(run_layers(split.layers, micro_batch) for micro_batch in split_rows(inputs, sizes))
    summed.backward()
    return whole, whole_grads, summed, gradients(model)


@pytest.mark.parametrize("sizes", SIZES, ids=str)
@pytest.mark.parametrize("family", available_families())
def test_sum_of_micro_batches_is_the_batch(family, sizes):
    # The router aux loss is a product of batch means and does not split (see test_router_aux_* below).
    model = build_model(family, output_router_logits=False) if family in MOE_FAMILIES else build_model(family)
    padding = "right" if family == "gemma2" else "mixed"  # see test_split_parity.py for Gemma2

    whole, whole_grads, summed, summed_grads = _whole_and_summed(model, make_batch(padding), sizes)

    assert_close(summed, whole, "summed loss")
    assert_same_gradients(summed_grads, whole_grads, float32_norms=family in FLOAT32_NORM_FAMILIES)


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES & set(available_families())))
def test_router_aux_is_token_weighted_over_micro_batches(family):
    """[Note: router statistics]: each micro-batch's aux loss, weighted by its share of the batch's tokens."""
    model = build_model(family)
    batch = make_batch("mixed")
    sizes = [2, 1]
    split = split_causal_lm(model)
    inputs = split.prepare_inputs(**batch)

    summed = sum(run_layers(split.layers, micro_batch) for micro_batch in split_rows(inputs, sizes))

    outputs = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_router_logits=True)
    masks = torch.split(batch["attention_mask"], sizes)
    router_logits = [logits.reshape(len(batch["input_ids"]), -1, logits.shape[-1]) for logits in outputs.router_logits]
    expected = reference_loss(model, {**batch}) - model.router_aux_loss_coef * switch_aux_loss(
        outputs.router_logits, model.num_experts, model.num_experts_per_tok, batch["attention_mask"]
    )
    total_tokens = batch["attention_mask"].sum()
    for index, mask in enumerate(masks):
        rows = slice(sum(sizes[:index]), sum(sizes[: index + 1]))
        logits = tuple(layer_logits[rows].reshape(-1, layer_logits.shape[-1]) for layer_logits in router_logits)
        aux = switch_aux_loss(logits, model.num_experts, model.num_experts_per_tok, mask)
        expected = expected + model.router_aux_loss_coef * aux * mask.sum() / total_tokens

    assert_close(summed, expected, "summed loss with router aux")


def test_router_aux_of_a_micro_batch_of_padding_only_is_zero():
    """A micro-batch holding only an empty example (mask and labels all padding) routes no token: its aux loss is
    zero, not 0 / 0 (a NaN loss and NaN gradients for the whole batch, where HF's batch loss is finite)."""
    model = build_model("qwen3_moe")
    batch = make_batch("left")
    batch["attention_mask"][2] = 0
    batch["labels"][2] = -100
    split = split_causal_lm(model)
    inputs = split.prepare_inputs(**batch)
    micro_batches = split_rows(inputs, [2, 1])
    summed = sum(run_layers(split.layers, micro_batch) for micro_batch in micro_batches)
    summed.backward()
    assert all(torch.isfinite(g).all() for g in gradients(model).values())

    # Every token of the batch is in the first micro-batch, so the token-weighted aux is HF's whole-batch aux.
    assert_close(summed, reference_loss(model, batch), "summed loss with an empty micro-batch")


def test_router_aux_of_one_micro_batch_is_hfs():
    model = build_model("qwen3_moe")
    batch = make_batch("left")
    split = split_causal_lm(model)
    loss = run_layers(split.layers, split.prepare_inputs(**batch))
    hf = model(**batch)
    assert hf.aux_loss is not None and hf.aux_loss > 0
    assert_close(loss, reference_loss(model, batch), "loss with router aux")
    assert_close(loss.detach(), hf.loss.detach(), "loss vs HF's float32 loss", rtol=1e-6)
