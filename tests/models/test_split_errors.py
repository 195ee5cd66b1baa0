"""A model the split cannot handle gets an error naming the missing piece and the way out."""

import pytest
import transformers
from torch import nn

from accelerate_roundpipe.models import FamilySpec, UnsupportedModelError, register_family, split_causal_lm
from accelerate_roundpipe.models.registry import _FAMILIES

from split_helpers import build_model

WAY_OUT = "pass that `torch.nn.Sequential` to `RoundPipe` directly"


def _split_error(model) -> str:
    with pytest.raises(UnsupportedModelError) as error:
        split_causal_lm(model)
    message = str(error.value)
    assert WAY_OUT in message
    return message


def test_plain_module():
    assert "has no `config`" in _split_error(nn.Sequential(nn.Linear(2, 2)))


def test_encoder_decoder():
    config = transformers.T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16, vocab_size=64)
    assert "encoder-decoder" in _split_error(transformers.T5ForConditionalGeneration(config))


def test_model_without_lm_head():
    model = build_model("llama").model  # LlamaModel: no head
    assert "lm_head" in _split_error(model)


def test_parameterised_part_the_forward_never_calls():
    model = build_model("llama")
    model.model.value_probe = nn.Linear(4, 4)  # held by the inner model, never called by its forward
    message = _split_error(model)
    assert "value_probe" in message and "does not call" in message


def test_missing_decoder_layers():
    model = build_model("llama")
    model.model.layers = nn.ModuleList(list(model.model.layers)[:1])  # no longer config.num_hidden_layers long
    assert "decoder layers" in _split_error(model)


def test_router_aux_loss_of_an_unregistered_family():
    model = build_model("qwen3_moe")
    saved = _FAMILIES.pop("qwen3_moe")
    try:
        message = _split_error(model)
    finally:
        register_family(saved)
    assert "output_router_logits = False" in message and "register_family" in message
    assert _FAMILIES["qwen3_moe"] == FamilySpec(name="qwen3_moe", switch_router_aux_loss=True)


def test_a_problem_ending_in_a_full_stop_keeps_one():
    """The integrations append their advice ("... use the stock Accelerator or Trainer.") to the problem."""
    from accelerate_roundpipe.integrations.convert import HOW_TO_TURN_OFF

    message = str(UnsupportedModelError(nn.Linear(1, 1), f"no lm_head. {HOW_TO_TURN_OFF}"))
    assert ".." not in message and "Accelerator or Trainer. " in message
