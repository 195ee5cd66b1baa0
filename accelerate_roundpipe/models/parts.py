"""Find the pieces of a Hugging Face causal LM: inner model, embeddings, decoder layers, final norm, lm_head.

Nothing is copied or changed here; `DecoderParts` only names the modules the split will wrap, so that every error
about an unsupported model comes from this one file.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from torch import nn

from .errors import UnsupportedModelError
from .model_kind import not_a_causal_lm
from .stand_ins import ProbeFailed, probe_part_order


@dataclass(frozen=True, kw_only=True)
class DecoderParts:
    """The modules of one decoder-only causal LM, each with the attribute name it has in its parent.

    `inner` is the model that holds the decoder layers, reached from `causal_lm` through `inner_path` (`("model",)`
    for `LlamaModel` under `.model`, `("transformer",)` for GPT-2, `("model", "decoder")` for OPT). It holds `embed`,
    the `decoder_layers` ModuleList, and the parameterised parts run before the layers (`before`, e.g. learned
    position embeddings) and after them (`after`, in call order: the final norm, an output projection); see
    [Note: parts around the decoder layers] in `stand_ins.py`. `lm_head` hangs off `causal_lm` directly.
    """

    causal_lm: nn.Module
    inner: nn.Module
    inner_path: tuple[str, ...]
    embed: nn.Module
    embed_name: str
    decoder_layers: nn.ModuleList
    layers_name: str
    before: tuple[str, ...]
    after: tuple[str, ...]
    lm_head: nn.Module
    lm_head_name: str


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The transformers model under a `peft.PeftModel` (with its LoRA modules in place), else `model` itself."""
    if type(model).__module__.startswith("peft") and hasattr(model, "get_base_model"):
        return model.get_base_model()
    return model


def refuse_if_not_a_causal_lm(model: nn.Module) -> None:
    """Refuse a model that is certainly not a decoder-only causal LM ([Note: causal LMs only] in `model_kind.py`),
    with the structural detail when its modules do not split either; its loss is not the head's next-token loss, so
    it is refused even when they do."""
    if not_a_causal_lm(model) is None:
        return
    find_decoder_parts(model)  # raises with the structural detail (the error leads with what RoundPipe trains)
    raise UnsupportedModelError(model, "its modules split, but the pipeline's head computes a causal LM's "
                                       "next-token loss, which is not this model's loss")


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
    _refuse_stray_parameters(model, causal_lm, allowed=(inner_name, lm_head_name), where="the causal LM")
    inner_path, inner = _descend_to_layers(model, causal_lm, inner_name)
    if "inputs_embeds" not in inspect.signature(inner.forward).parameters:
        raise UnsupportedModelError(model, f"the inner model {type(inner).__name__} does not accept `inputs_embeds`")
    if "per_layer_inputs" in inspect.signature(inner.forward).parameters and getattr(
            getattr(inner, "config", config), "hidden_size_per_layer_input", 0):
        # Gemma 3n / Gemma 4 per-layer embeddings: a layer's captured arguments would have to be rebuilt from the
        # token ids, which only the first pipeline layer sees (HF would reverse the input embedding to find them).
        raise UnsupportedModelError(
            model, f"{type(inner).__name__}'s decoder layers read per-layer input embeddings computed from the token "
            "ids (config.hidden_size_per_layer_input), which the split does not carry between pipeline layers yet",
        )

    embed = causal_lm.get_input_embeddings() if hasattr(causal_lm, "get_input_embeddings") else None
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

    before, after = _parts_around_layers(model, inner, embed_name, layers_name)
    return DecoderParts(
        causal_lm=causal_lm,
        inner=inner,
        inner_path=inner_path,
        embed=embed,
        embed_name=embed_name,
        decoder_layers=inner._modules[layers_name],
        layers_name=layers_name,
        before=before,
        after=after,
        lm_head=lm_head,
        lm_head_name=lm_head_name,
    )


def _descend_to_layers(model: nn.Module, causal_lm: nn.Module, inner_name: str) -> tuple[tuple[str, ...], nn.Module]:
    """The module holding the decoder layers: the inner model itself, or the one parameterised child of a wrapper
    that holds nothing else (OPT's `model.decoder`, the decoder of Bart-style `*ForCausalLM`s)."""
    path, inner = (inner_name,), causal_lm._modules[inner_name]
    while _decoder_layers_name(inner) is None:
        holders = [name for name, child in inner.named_children() if _has_parameters(child)]
        if len(holders) != 1 or inner._parameters:
            break
        path, inner = (*path, holders[0]), inner._modules[holders[0]]
    return path, inner


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
    """The ModuleList of `config.num_hidden_layers` modules (`config.decoder_layers` in the decoders of Bart-style
    models, whose `num_hidden_layers` counts the encoder's)."""
    counts = {getattr(inner.config, "num_hidden_layers", None), getattr(inner.config, "decoder_layers", None)} - {None}
    candidates = [
        name for name, child in inner.named_children() if isinstance(child, nn.ModuleList) and len(child) in counts
    ]
    return candidates[0] if len(candidates) == 1 else None


def _parts_around_layers(
    model: nn.Module, inner: nn.Module, embed_name: str, layers_name: str
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The parameterised children of the inner model run before and after its decoder layers, in call order (see
    [Note: parts around the decoder layers]); a part used between layers or never is refused."""
    if inner._parameters:
        raise UnsupportedModelError(
            model, f"{type(inner).__name__} holds parameters of its own ({', '.join(inner._parameters)})"
        )
    parts = [name for name, child in inner.named_children() if name != layers_name and _has_parameters(child)]
    try:
        calls = probe_part_order(inner, layers_name, parts)
    except ProbeFailed as error:
        raise UnsupportedModelError(
            model, f"{type(inner).__name__}.forward failed before its first decoder layer when probed ({error})"
        ) from error
    layer_calls = [index for index, call in enumerate(calls) if call.startswith("layer ")]
    if not layer_calls:
        raise UnsupportedModelError(model, f"{type(inner).__name__}.forward never called its decoder layers")
    first, last = layer_calls[0], layer_calls[-1]
    between = sorted({call for call in calls[first:last] if not call.startswith("layer ")})
    if between:
        raise UnsupportedModelError(
            model,
            f"{type(inner).__name__} uses the parameterised parts {', '.join(between)} between its decoder layers "
            "(state shared across layers), which a pipeline of independent layers cannot carry",
        )
    unused = [name for name in parts if name not in calls]
    if unused:
        raise UnsupportedModelError(
            model,
            f"{type(inner).__name__} has parameterised parts its forward does not call on token ids "
            f"({', '.join(unused)}); the split cannot tell where they are used",
        )
    before = tuple(_unique(call for call in calls[:first] if call != embed_name))
    after = tuple(_unique(calls[last + 1 :]))
    after = _with_parameter_free_parts_after(inner, layers_name, parts, after)
    if embed_name in after:
        raise UnsupportedModelError(model, f"{type(inner).__name__} uses its input embedding after its decoder layers")
    return before, after


def _with_parameter_free_parts_after(inner: nn.Module, layers_name: str, parts: list[str],
                                     after: tuple[str, ...]) -> tuple[str, ...]:
    """`after` (the parameterised parts run after the decoder layers) with the parameter-free children run there too,
    in call order: a final norm without weights (OLMo's LayerNorm) is part of the head like any other. Found by a
    second probe that records every child; if it fails or orders the parameterised parts otherwise, `after` stays
    as it is (a parameter-free part the head then does not apply would make the logits differ from HF's, which the
    parity tests check)."""
    free = [name for name, child in inner.named_children()
            if name != layers_name and name not in parts and not _has_parameters(child)]
    if not free:
        return after
    try:
        calls = probe_part_order(inner, layers_name, [*parts, *free])
    except ProbeFailed:
        return after
    layer_calls = [index for index, call in enumerate(calls) if call.startswith("layer ")]
    if not layer_calls:
        return after
    found = tuple(_unique(calls[layer_calls[-1] + 1:]))
    if tuple(name for name in found if name in parts) != after:
        return after
    return found


def _unique(names) -> list[str]:
    return list(dict.fromkeys(names))


def _refuse_stray_parameters(model: nn.Module, parent: nn.Module, allowed: tuple[str, ...], where: str) -> None:
    stray = [name for name, child in parent.named_children() if name not in allowed and _has_parameters(child)]
    stray += list(parent._parameters)
    if stray:
        raise UnsupportedModelError(
            model,
            f"{where} has parameterised parts outside the inner decoder model and lm_head ({', '.join(stray)}), "
            "e.g. a vision tower or a value head",
        )
