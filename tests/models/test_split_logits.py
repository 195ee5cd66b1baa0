"""Without labels the last layer returns the logits, as `model(...).logits` gives them."""

import pytest
import torch

from accelerate_roundpipe.models import split_causal_lm

from split_helpers import assert_close, available_families, build_model, make_batch, run_layers, split_rows


@pytest.mark.parametrize("family", available_families())
def test_logits_match_hf(family):
    model = build_model(family).eval()
    batch = make_batch("right")
    split = split_causal_lm(model)

    inputs = split.prepare_inputs(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    with torch.no_grad():
        logits = run_layers(split.layers, inputs)
        by_micro_batch = torch.cat([run_layers(split.layers, part) for part in split_rows(inputs, [1, 2])])
        expected = model(**batch).logits

    assert logits.shape == expected.shape
    assert_close(logits, expected, "logits")
    assert_close(by_micro_batch, expected, "logits by micro-batch")


def test_logits_mode_has_only_compact_inputs():
    split = split_causal_lm(build_model("qwen3_moe"))
    batch = make_batch("left")
    without_labels = split.prepare_inputs(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    with_labels = split.prepare_inputs(**batch)
    assert len(without_labels) == 3  # input_ids, attention_mask, position_ids
    assert len(with_labels) == 8  # + router_counts, router_probs, batch_tokens, labels, num_items_in_batch
    for tensor in with_labels:
        assert tensor.shape[0] == batch["input_ids"].shape[0]
        assert tensor.dim() <= 2
