"""Find the pieces of a Hugging Face causal LM: inner model, embeddings, decoder layers, final norm, lm_head.

Nothing is copied or changed here; `DecoderParts` only names the modules the split will wrap, so that every error
about an unsupported model comes from this one file.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from torch import nn

from .errors import UnsupportedModelError


@dataclass(frozen=True, kw_only=True)
class DecoderParts:
    """The modules of one decoder-only causal LM, each with the attribute name it has in its parent.

    `inner` is the model the causal LM calls (`causal_lm.<inner_name>`, e.g. `LlamaModel` under `.model`); it holds
    `embed`, the `decoder_layers` ModuleList and `norm` (None when the model has no final norm). `lm_head` hangs off
    `causal_lm` directly.
    """

    causal_lm: nn.Module
    inner: nn.Module
    inner_name: str
    embed: nn.Module
    embed_name: str
    decoder_layers: nn.ModuleList
    layers_name: str
    norm: nn.Module | None
    norm_name: str | None
    lm_head: nn.Module
    lm_head_name: str


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The transformers model under a `peft.PeftModel` (with its LoRA modules in place), else `model` itself."""
    if type(model).__module__.startswith("peft") and hasattr(model, "get_base_model"):
        return model.get_base_model()
    return model


def find_decoder_parts(model: nn.Module) -> DecoderParts:
    """Locate the pieces of `model` (a `*ForCausalLM`, possibly wrapped in PEFT) or raise `UnsupportedModelError`."""
    causal_lm = unwrap_peft(model)
    config = getattr(causal_lm, "config", None)
    if config is None:
        raise UnsupportedModelError(model, "it has no `config`, so it is not a Hugging Face model")
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            model, "encoder-decoder models are not supported (only decoder-only causal LMs such as *ForCausalLM)"
        )

    lm_head = causal_lm.get_output_embeddings() if hasattr(causal_lm, "get_output_embeddings") else None
    if lm_head is None:
        raise UnsupportedModelError(model, "no output embedding (`lm_head`) found; is this a *ForCausalLM model?")
    lm_head_name = _child_name(causal_lm, lm_head)
    if lm_head_name is None:
        raise UnsupportedModelError(model, "the output embedding (`lm_head`) is not a direct child of the model")

    inner_name = _inner_model_name(causal_lm, lm_head_name)
    if inner_name is None:
        raise UnsupportedModelError(
            model,
            f"no inner decoder model found (a child under `base_model_prefix` "
            f"{getattr(causal_lm, 'base_model_prefix', '')!r} or `model` with `get_input_embeddings`)",
        )
    inner = causal_lm._modules[inner_name]
    if "inputs_embeds" not in inspect.signature(inner.forward).parameters:
        raise UnsupportedModelError(model, f"the inner model {type(inner).__name__} does not accept `inputs_embeds`")
    _refuse_stray_parameters(model, causal_lm, allowed=(inner_name, lm_head_name), where="the causal LM")

    embed = inner.get_input_embeddings() if hasattr(inner, "get_input_embeddings") else None
    embed_name = _child_name(inner, embed) if embed is not None else None
    if embed_name is None:
        raise UnsupportedModelError(
            model, f"no input embedding (`embed_tokens`) found as a direct child of {type(inner).__name__}"
        )

    layers_name = _decoder_layers_name(inner)
    if layers_name is None:
        raise UnsupportedModelError(
            model,
            f"no list of decoder layers (an nn.ModuleList of config.num_hidden_layers modules, e.g. `model.layers`) "
            f"found in {type(inner).__name__}",
        )

    norm_name = _final_norm_name(model, inner, used=(embed_name, layers_name))
    return DecoderParts(
        causal_lm=causal_lm,
        inner=inner,
        inner_name=inner_name,
        embed=embed,
        embed_name=embed_name,
        decoder_layers=inner._modules[layers_name],
        layers_name=layers_name,
        norm=inner._modules[norm_name] if norm_name else None,
        norm_name=norm_name,
        lm_head=lm_head,
        lm_head_name=lm_head_name,
    )


def _inner_model_name(causal_lm: nn.Module, lm_head_name: str) -> str | None:
    """`base_model_prefix` names it in most models; some (Gemma3ForCausalLM in transformers 4.x) keep it at `model`."""
    for name in (getattr(causal_lm, "base_model_prefix", ""), "model"):
        if name and name != lm_head_name and hasattr(causal_lm._modules.get(name), "get_input_embeddings"):
            return name
    return None


def _child_name(parent: nn.Module, child: nn.Module) -> str | None:
    return next((name for name, module in parent.named_children() if module is child), None)


def _has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _decoder_layers_name(inner: nn.Module) -> str | None:
    num_layers = getattr(inner.config, "num_hidden_layers", None)
    candidates = [
        name for name, child in inner.named_children() if isinstance(child, nn.ModuleList) and len(child) == num_layers
    ]
    return candidates[0] if len(candidates) == 1 else None


def _final_norm_name(model: nn.Module, inner: nn.Module, used: tuple[str, ...]) -> str | None:
    """The one parameterised child of the inner model besides embeddings and layers: the final norm.

    A second one (e.g. learned position embeddings, a vision tower) would be used somewhere the split cannot see,
    so it is refused rather than guessed at.
    """
    if inner._parameters:
        raise UnsupportedModelError(
            model, f"{type(inner).__name__} holds parameters of its own ({', '.join(inner._parameters)})"
        )
    others = [name for name, child in inner.named_children() if name not in used and _has_parameters(child)]
    if len(others) > 1:
        raise UnsupportedModelError(
            model,
            f"{type(inner).__name__} has parameterised submodules besides the embeddings, decoder layers and final "
            f"norm ({', '.join(others)}); the split cannot tell where they are used",
        )
    return others[0] if others else None


def _refuse_stray_parameters(model: nn.Module, parent: nn.Module, allowed: tuple[str, ...], where: str) -> None:
    stray = [name for name, child in parent.named_children() if name not in allowed and _has_parameters(child)]
    stray += list(parent._parameters)
    if stray:
        raise UnsupportedModelError(
            model,
            f"{where} has parameterised parts outside the inner decoder model and lm_head ({', '.join(stray)}), "
            "e.g. a vision tower or a value head",
        )
