"""A model that is not a decoder-only causal LM is refused with what RoundPipe trains first, then the detail
([Note: causal LMs only] in `models/model_kind.py`). Tiny models built from configs, nothing downloaded."""

import pytest
import transformers

from accelerate_roundpipe.models import UnsupportedModelError, split_causal_lm

from split_helpers import build_model

LEAD = "RoundPipe trains decoder-only causal language models"


def _refusal(model) -> str:
    with pytest.raises(UnsupportedModelError) as error:
        split_causal_lm(model)
    return str(error.value)


def _tiny_bert_config():
    return transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                   vocab_size=64)


def test_a_masked_lm_is_refused_as_not_a_causal_lm_first():
    message = _refusal(transformers.BertForMaskedLM(_tiny_bert_config()))
    assert message.startswith(LEAD), message
    assert "BertForMaskedLM is a masked language model" in message
    assert "Cannot split BertForMaskedLM" in message  # the structural detail follows
    assert message.index(LEAD) < message.index("not a direct child")


def test_an_encoder_decoder_model_is_refused_as_not_a_causal_lm_first():
    config = transformers.T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16, vocab_size=64)
    message = _refusal(transformers.T5ForConditionalGeneration(config))
    assert message.startswith(LEAD), message
    assert "T5ForConditionalGeneration is an encoder-decoder model" in message


def test_a_sequence_classifier_is_refused_as_not_a_causal_lm_first():
    causal = build_model("llama")
    classifier = transformers.LlamaForSequenceClassification(causal.config)
    message = _refusal(classifier)
    assert message.startswith(LEAD), message
    assert "LlamaForSequenceClassification is a sequence classifier" in message
    assert "LlamaForCausalLM" in message  # the family's causal LM, named as the way to go


def test_a_base_model_without_head_is_refused_as_not_a_causal_lm_first():
    message = _refusal(build_model("llama").model)
    assert message.startswith(LEAD), message
    assert "LlamaModel is a base model without a language-model head" in message
    assert "lm_head" in message


def test_a_causal_lm_refused_for_a_structural_reason_gets_no_lead():
    """A causal LM whose structure the split cannot handle is not told it is not a causal LM."""
    model = build_model("llama")
    model.model.layers = type(model.model.layers)(list(model.model.layers)[:1])
    message = _refusal(model)
    assert LEAD not in message and "decoder layers" in message


def test_the_accelerate_way_in_keeps_the_lead():
    from accelerate_roundpipe import RoundPipeAccelerator, RoundPipePlugin

    accelerator = RoundPipeAccelerator(roundpipe_plugin=RoundPipePlugin(devices=["cpu", "cpu"]))
    with pytest.raises(UnsupportedModelError) as error:
        accelerator.prepare(transformers.BertForMaskedLM(_tiny_bert_config()))
    message = str(error.value)
    assert message.startswith(LEAD) and "without RoundPipe" in message, message
