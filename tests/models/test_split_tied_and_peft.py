"""Tied embeddings stay one Parameter; PEFT LoRA adapters train inside the layers, the frozen base stays frozen."""

import pytest

from accelerate_roundpipe.models import split_causal_lm

from split_helpers import (
    assert_close,
    assert_same_gradients,
    build_model,
    gradients,
    lora_model,
    make_batch,
    reference_loss,
    run_layers,
)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_tied_embedding_is_one_parameter_in_first_and_last_layer(family):
    model = build_model(family, tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    split = split_causal_lm(model)

    tied = model.lm_head.weight
    assert any(p is tied for p in split.layers[0].parameters())
    assert any(p is tied for p in split.layers[-1].parameters())
    assert sum(p is tied for p in split.layers.parameters()) == 1  # the Sequential lists it once

    batch = make_batch("left")
    expected = reference_loss(model, batch)
    expected.backward()
    expected_grads = gradients(model)
    model.zero_grad()
    loss = run_layers(split.layers, split.prepare_inputs(**batch))
    loss.backward()
    assert_close(loss, expected, "loss")
    assert_same_gradients(gradients(model), expected_grads)


def test_peft_lora_adapters_train_and_base_stays_frozen():
    pytest.importorskip("peft")
    peft_model = lora_model("qwen3", ["q_proj", "v_proj", "down_proj"])
    batch = make_batch("mixed")

    expected = reference_loss(peft_model, batch)
    expected.backward()
    expected_grads = gradients(peft_model)
    peft_model.zero_grad()

    split = split_causal_lm(peft_model)
    loss = run_layers(split.layers, split.prepare_inputs(**batch))
    loss.backward()

    assert_close(loss, expected, "loss")
    grads = gradients(peft_model)
    assert grads and all("lora_" in name for name in grads)
    assert_same_gradients(grads, expected_grads)
    trainable = {id(p) for p in split.layers.parameters() if p.requires_grad}
    assert trainable == {id(p) for name, p in peft_model.named_parameters() if "lora_" in name}
    assert all(p.grad is None for p in split.layers.parameters() if not p.requires_grad)
