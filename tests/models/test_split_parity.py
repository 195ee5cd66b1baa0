"""The split layers, run in order on the whole batch, give HF's loss and HF's gradients (float64)."""

import pytest
import torch

from accelerate_roundpipe.models import split_causal_lm

from split_helpers import (
    assert_close,
    assert_same_gradients,
    available_families,
    build_model,
    gradients,
    make_batch,
    reference_loss,
    run_layers,
)

# HF's own eager attention gives NaN for fully padded query rows of left-padded float64 batches (Gemma2 needs eager
# for its attention soft-capping), so Gemma2 is checked on right padding and unpadded batches only.
CASES = [
    (family, padding)
    for family in available_families()
    for padding in (("right", "none") if family == "gemma2" else ("left", "right", "mixed"))
]


@pytest.mark.parametrize(("family", "padding"), CASES)
def test_loss_and_gradients_match_hf(family, padding):
    model = build_model(family)
    batch = make_batch(padding)

    expected = reference_loss(model, batch)
    expected.backward()
    expected_grads = gradients(model)
    hf_loss = model(**batch).loss.detach()  # HF upcasts logits to float32 only: a looser check
    model.zero_grad()

    split = split_causal_lm(model)
    loss = run_layers(split.layers, split.prepare_inputs(**batch))
    loss.backward()

    assert loss.dim() == 0
    assert_close(loss, expected, "loss")
    assert_close(loss.detach(), hf_loss, "loss vs HF's float32 loss", rtol=1e-6)
    assert_same_gradients(gradients(model), expected_grads)


def test_inputs_embeds_match_hf():
    model = build_model("gemma3")  # Gemma scales embeddings inside the embedding module, not for inputs_embeds
    batch = make_batch("left")
    embeds = torch.randn(*batch["input_ids"].shape, model.config.hidden_size, dtype=torch.float64)
    batch = {"inputs_embeds": embeds, "attention_mask": batch["attention_mask"], "labels": batch["labels"]}

    split = split_causal_lm(model)
    loss = run_layers(split.layers, split.prepare_inputs(**batch))
    assert_close(loss, reference_loss(model, batch), "loss")


def test_num_items_in_batch_is_the_divisor():
    model = build_model("llama")
    batch = make_batch("right")
    split = split_causal_lm(model)
    default = run_layers(split.layers, split.prepare_inputs(**batch))
    count = (batch["labels"][:, 1:] != -100).sum()

    given = run_layers(split.layers, split.prepare_inputs(**batch, num_items_in_batch=3 * count))
    assert_close(given, default / 3, "loss with num_items_in_batch")
    hf = model(**batch, num_items_in_batch=3 * count).loss
    assert_close(given.detach(), hf.detach(), "loss vs HF", rtol=1e-6)


def test_packed_sequences_without_mask_match_hf():
    """No attention mask and restarting position ids: packed sequences, as HF treats them without a KV cache.

    (With its default `use_cache=True` HF skips packed-sequence detection even in training; the split never uses a
    cache, so it matches HF with `use_cache=False`.)
    """
    model = build_model("llama")
    batch = make_batch("none")
    batch["position_ids"] = torch.tensor([list(range(5)) + list(range(7))] * 3)
    split = split_causal_lm(model)
    loss = run_layers(split.layers, split.prepare_inputs(**batch))
    assert_close(loss, reference_loss(model, batch, use_cache=False), "loss")
    unpacked = reference_loss(model, {k: v for k, v in batch.items() if k != "position_ids"}, use_cache=False)
    assert (loss - unpacked).abs() > 1e-6, "packing had no effect: the test would not catch a missing packed mask"


def test_hf_gradient_checkpointing_is_turned_off():
    model = build_model("qwen3")
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    split_causal_lm(model)
    assert not any(getattr(module, "gradient_checkpointing", False) for module in model.modules())


def test_loss_is_computed_in_small_chunks():
    """With 4-token chunks the lm_head never sees more than 4 tokens, in forward or in backward's recompute."""
    model = build_model("gemma2", tie_word_embeddings=True)  # soft-capped logits, tied head
    batch = make_batch("right")
    expected = reference_loss(model, batch)
    expected.backward()
    expected_grads = gradients(model)
    model.zero_grad()

    split = split_causal_lm(model, loss_chunk_tokens=4)
    seen_tokens = []
    handle = model.lm_head.register_forward_hook(
        lambda module, args, out: seen_tokens.append(args[0].shape[:2].numel())
    )
    loss = run_layers(split.layers, split.prepare_inputs(**batch))
    calls_in_forward = len(seen_tokens)
    loss.backward()
    handle.remove()

    assert max(seen_tokens) <= 4
    assert calls_in_forward == 12 and len(seen_tokens) == 24  # 12 one-position chunks of 3 rows, each recomputed
    assert_close(loss, expected, "loss")
    assert_same_gradients(gradients(model), expected_grads, float32_norms=True)
