"""What differs between decoder-only families, keyed by `config.model_type`.

Most of what a family does differently (attention masks per layer type, sliding windows, rotary variants, attention
sinks, embedding scaling, logit soft-capping) is picked up from the model's own code by the shells in `shell.py`, so
it needs no entry here. An entry is only needed for what the model computes from *all* layers at once, which a
pipeline must carry from layer to layer itself: today that is the router load-balancing loss of mixture-of-experts
models.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from .errors import UnsupportedModelError
from .verified_families import VERIFIED_MODEL_TYPES

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class FamilySpec:
    """How one family of causal LMs differs from the generic decoder-only split.

    Args:
        name (`str`): the family's `config.model_type`, or "generic".
        switch_router_aux_loss (`bool`, defaults to `False`): HF adds the Switch-Transformer load-balancing loss of
            its routers (`load_balancing_loss_func`, weighted by `router_aux_loss_coef`) to the loss when
            `config.output_router_logits` is true. The split then carries router statistics through the layers
            (see [Note: router statistics] in `router_aux.py`). The causal LM must have `num_experts`,
            `num_experts_per_tok` and `router_aux_loss_coef` attributes and its inner model must declare its router
            output in `_can_record_outputs["router_logits"]`.
    """

    name: str
    switch_router_aux_loss: bool = False


GENERIC = FamilySpec(name="generic")

_FAMILIES: dict[str, FamilySpec] = {
    # Each checked against HF in tests/models. They share one load-balancing function (copied between their
    # modeling files); GPT-OSS's attention sinks and sliding/full alternation need nothing here. Qwen3.5-MoE's text
    # model (the causal LM's `model_type`) is checked with LoRA on its experts (tests/models/test_lora_on_experts.py).
    name: FamilySpec(name=name, switch_router_aux_loss=True)
    for name in ("qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss", "olmoe", "qwen3_5_moe_text")
}


# [Note: families that do not match HF]
# Families the generic split accepts whose split, in the float64 parity check over transformers' causal-LM list
# (tests/models/test_decoder_catalog.py), does not give HF's loss, logits or gradients, or crashes. Refused with
# what was measured, so a user never trains one silently wrong; each leaves this list with a fix and its parity test.
NOT_MATCHING_HF: dict[str, str] = {
    "deepseek_v4": "its attention crashes on the split's inputs (a tensor of 5 dimensions expanded as 4)",
    "dory": "its logits differ from HF's (0.65 relative)",
    "openai-gpt": "splitting it crashes (StopIteration)",
    "xglm": "its forward overflows on the split's inputs",
}


def refuse_if_not_matching(causal_lm) -> None:
    """Refuse a family listed in `NOT_MATCHING_HF` ([Note: families that do not match HF]); warn for one that no
    parity test checks (`verified_families.py`)."""
    model_type = getattr(getattr(causal_lm, "config", None), "model_type", "")
    if model_type and model_type not in VERIFIED_MODEL_TYPES and model_type not in NOT_MATCHING_HF:
        logger.warning("RoundPipe: model_type %r is split by the generic rules, but no parity test checks it against "
                       "the model's own forward (no tiny model of it could be built for the check; see "
                       "docs/models.md). Compare a few losses with a plain run before relying on it.", model_type)
    reason = NOT_MATCHING_HF.get(model_type)
    if reason is not None:
        raise UnsupportedModelError(
            causal_lm,
            f"model_type {model_type!r} is not supported yet: split into pipeline layers, {reason} in RoundPipe's "
            "parity check against the model's own forward, so training it would be silently wrong",
        )


def register_family(spec: FamilySpec) -> None:
    """Add or replace the entry for `spec.name` (a `config.model_type`)."""
    _FAMILIES[spec.name] = spec


def family_for(causal_lm) -> FamilySpec:
    """The entry for this model, or `GENERIC`; refuses a router aux loss that no entry describes."""
    config = causal_lm.config
    spec = _FAMILIES.get(getattr(config, "model_type", ""), GENERIC)
    if (
        not spec.switch_router_aux_loss
        and getattr(config, "output_router_logits", False)
        and hasattr(causal_lm, "router_aux_loss_coef")
    ):
        raise UnsupportedModelError(
            causal_lm,
            f"model_type {config.model_type!r} adds a router auxiliary loss (config.output_router_logits=True) that "
            "no family entry describes. Set `config.output_router_logits = False` to train without it, or describe "
            "the family with `accelerate_roundpipe.models.register_family(FamilySpec(name=..., "
            "switch_router_aux_loss=True))` if it uses HF's Switch load-balancing loss",
        )
    return spec
