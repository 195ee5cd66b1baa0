"""[Note: adapter switches]: PEFT's `disable_adapter()` and `set_adapter(...)` on the user's model reach the
devices' copies of the layers (float64 logits equal plain PEFT's under each setting, 1e-10), and the switches that
cannot be followed (a merged adapter, training other parameters than the engine was built with) are refused."""

from __future__ import annotations

import copy

import pytest
import torch

from accelerate_roundpipe import RoundPipeConfig, wrap_model

from split_helpers import assert_close, lora_model, make_batch

peft = pytest.importorskip("peft")

TARGETS = ["q_proj", "v_proj", "down_proj"]


def two_adapter_model():
    model = lora_model("llama", TARGETS)
    model.add_adapter("other", peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=TARGETS,
                                                init_lora_weights=False))
    return model


def logits(model, batch):
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


@pytest.fixture
def engines():
    model = two_adapter_model()
    reference = copy.deepcopy(model).eval()
    engine = wrap_model(model, RoundPipeConfig(devices=["cpu"] * 2, num_microbatches=2))
    model.eval()
    try:
        yield engine, model, reference
    finally:
        engine.close()


def test_disable_adapter_reaches_the_devices(engines):
    engine, model, reference = engines
    batch = make_batch("left")
    with_adapters = logits(reference, batch)
    with reference.disable_adapter():
        without = logits(reference, batch)
    assert (with_adapters - without).abs().max() > 1e-3  # the adapters matter: the check below can fail
    assert_close(logits(model, batch), with_adapters, "logits with the adapter")
    with model.disable_adapter():
        assert_close(logits(model, batch), without, "logits inside disable_adapter()")
    assert_close(logits(model, batch), with_adapters, "logits after disable_adapter()")


def test_set_adapter_reaches_the_devices_and_training_another_adapter_is_refused(engines):
    engine, model, reference = engines
    batch = make_batch("mixed")
    logits(model, batch)  # the devices make their copies with the first adapter active
    reference.set_adapter("other")
    model.set_adapter("other")
    assert_close(logits(model, batch), logits(reference, batch), "logits of the other adapter")
    with pytest.raises(ValueError, match="parameters that require grad changed.*set_adapter"):
        engine.forward_backward(**batch)
    model.set_adapter("default")
    reference.set_adapter("default")
    assert_close(logits(model, batch), logits(reference, batch), "logits back on the first adapter")
    loss = engine.forward_backward(**batch)  # the engine's own adapter again: trains
    assert torch.isfinite(loss)


def test_a_merged_adapter_is_refused(engines):
    engine, model, _ = engines
    batch = make_batch("right")
    model.merge_adapter()
    with pytest.raises(ValueError, match="merged.*unmerge_adapter"):
        logits(model, batch)


def test_merge_and_unload_on_a_wrapped_model_is_refused_naming_what_to_do(engines):
    """merge_and_unload() after training (the usual end of a LoRA run) while the engine still runs the model: the
    merged model is right as a plain model, and the engine's next pass is refused with a message that names
    merge_and_unload and says to close the engine (it once only said to merge_and_unload before wrapping)."""
    engine, model, reference = engines
    batch = make_batch("right")
    logits(model, batch)
    merged = model.merge_and_unload()
    expected = logits(reference.merge_and_unload(), batch)
    with pytest.raises(ValueError, match=r"merge_and_unload\(\) while RoundPipe runs the model.*engine.close\(\)"):
        engine.forward_backward(**batch)
    engine.close()
    assert_close(logits(merged, batch), expected, "the merged model's logits, as a plain model")
