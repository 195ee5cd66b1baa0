"""What kind of Hugging Face model something is, when it is certainly not a decoder-only causal LM.

[Note: causal LMs only]
The split turns a decoder-only causal LM into pipeline layers whose head computes the next-token loss. A masked LM,
a classifier, a base model without a head or an encoder-decoder model has another loss (or none), so it is refused
even where its modules would happen to split, and every refusal of such a model (`UnsupportedModelError`) says first
what RoundPipe trains and what this model is, then the structural detail. The kind is read from transformers' own
auto-class tables: a class listed as a causal LM (or named `*ForCausalLM` / `*LMHeadModel`, as custom code names
them) is never called anything else, so a causal LM refused for its structure gets the detail alone.
"""

from __future__ import annotations

# transformers' auto tables (in `transformers.models.auto.modeling_auto`) -> what a model listed there is.
_OTHER_KINDS = (
    ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "a masked language model (an encoder that predicts masked tokens)"),
    ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "a sequence classifier (no language-model head)"),
    ("MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", "a token classifier (no language-model head)"),
    ("MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES", "a question-answering model (no language-model head)"),
    ("MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES", "a multiple-choice model (no language-model head)"),
    ("MODEL_FOR_PRETRAINING_MAPPING_NAMES", "a pretraining model (masked-LM and sentence heads)"),
    ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "an encoder-decoder model"),
    ("MODEL_MAPPING_NAMES", "a base model without a language-model head"),
)
WHAT_ROUNDPIPE_TRAINS = ("RoundPipe trains decoder-only causal language models (a `*ForCausalLM` such as "
                         "LlamaForCausalLM, or a PEFT model around one)")


def _class_names(table: dict) -> set[str]:
    names: set[str] = set()
    for value in table.values():
        names.update((value,) if isinstance(value, str) else value)
    return names


def _bare(model: object) -> object:
    """The transformers model under a `peft.PeftModel`, else `model` (as `parts.unwrap_peft`)."""
    if type(model).__module__.startswith("peft") and hasattr(model, "get_base_model"):
        return model.get_base_model()
    return model


def not_a_causal_lm(model: object) -> str | None:
    """What `model` is when it is certainly not a decoder-only causal LM ("a masked language model", ...), with
    the family's causal LM where transformers has one; None for a causal LM or anything unknown."""
    model = _bare(model)
    config = getattr(model, "config", None)
    if config is None:
        return None  # not a Hugging Face model: the refusal says so itself
    try:
        from transformers.models.auto import modeling_auto
    except ImportError:
        return None
    classes = {cls.__name__ for cls in type(model).__mro__}
    causal = _class_names(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    if classes & causal or any(name.endswith(("ForCausalLM", "LMHeadModel")) for name in classes):
        return None
    if getattr(config, "is_encoder_decoder", False):
        kind = "an encoder-decoder model"
    else:
        kind = next((what for table, what in _OTHER_KINDS
                     if classes & _class_names(getattr(modeling_auto, table, {}))), None)
        if kind is None:
            return None
    family_lm = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(config, "model_type", ""))
    if isinstance(family_lm, str) and family_lm.endswith("ForCausalLM"):
        kind += f"; its family's causal LM is {family_lm}"
    return kind
