"""`split_causal_lm`: a Hugging Face decoder-only causal LM as the `nn.Sequential` of layers the engine runs."""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from .batch import build_batch
from .fused_ce import DEFAULT_CHUNK_TOKENS
from .head import CausalLMHead, FinalNorm
from .layers import DecoderLayer, EmbeddingLayer
from .parts import DecoderParts, find_decoder_parts, refuse_if_not_a_causal_lm
from .registry import FamilySpec, family_for, refuse_if_not_matching
from .router_aux import install_router_hooks
from .shell import PLAIN_ATTRIBUTE_TYPES, UnusedPart, decoder_stubs, make_shell
from .stand_ins import ShapeOnlyPart
from .vocab_shards import shard_head

logger = logging.getLogger(__name__)

# Smaller micro-batches get smaller chunks ([Note: loss chunk size] in head.py).
DEFAULT_LOSS_CHUNK_TOKENS = DEFAULT_CHUNK_TOKENS


@dataclass(kw_only=True)
class DecoderSplit:
    """A causal LM cut into pipeline layers, and the function that builds their input batch.

    `layers` is `EmbeddingLayer -> DecoderLayer x num_hidden_layers -> CausalLMHead` (or `head_shards` x
    `VocabShard`). Its parameters are the model's own Parameter objects (a tied `lm_head.weight` is the
    embedding's, in the first and the last layers).

    What the last layer returns depends on the batch alone ([Note: decoder batch layout] in `layers.py`): a batch
    from `prepare_inputs(..., labels=...)` gives the micro-batch loss (0-dim, already divided by the whole batch's
    label count, so the sum over micro-batches is the batch loss); a batch without labels gives the logits
    [b, T, vocab] as `model(...).logits` would.
    """

    layers: nn.Sequential
    family: FamilySpec
    router_experts: int | None = None
    source_model: nn.Module = field(repr=False)

    def prepare_inputs(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        router_statistics: bool = False,
        token_fields: bool = False,
        batch_tokens: int | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """The whole batch as the tuple layer 0 takes; every tensor has the batch rows on dim 0 and may be split.

        `router_statistics=True` without labels (MoE models with a router aux loss only) makes the last layer return
        `(logits, router_counts, router_probs)`, from which `batch_router_aux_loss` gives HF's aux loss.
        `token_fields=True` (with labels) makes it return the labels' per-token log-probabilities instead of a loss
        ([Note: per-token fields] in `token_fields.py`).
        """
        return build_batch(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            labels=labels,
            inputs_embeds=inputs_embeds,
            num_items_in_batch=num_items_in_batch,
            router_experts=self.router_experts,
            router_probs_dtype=torch.promote_types(self._parameter_dtype(), torch.float32),
            router_statistics=router_statistics,
            token_fields=token_fields,
            batch_tokens=batch_tokens,
        )

    def parameter_names(self) -> dict[str, str]:
        """Name of each parameter in `layers` (as `layers.named_parameters()` gives it) -> its name in the model."""
        # A tied parameter gets the name the model lists first (as `named_parameters()` does).
        source_names = {id(p): name for name, p in self.source_model.named_parameters()}
        return {name: source_names[id(p)] for name, p in self.layers.named_parameters()}

    def _parameter_dtype(self) -> torch.dtype:
        return next(self.layers[-1].parameters()).dtype


def split_causal_lm(model: nn.Module, *, loss_chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS,
                    head_shards: int = 1) -> DecoderSplit:
    """Split a decoder-only HF causal LM (or a `peft.PeftModel` around one) into pipeline layers.

    Args:
        model: a `*ForCausalLM` such as Llama, Mistral, Qwen2/3, Qwen3-MoE, Gemma2/3, Phi3, GPT-OSS; with PEFT, the
            LoRA adapters stay inside the decoder layers and frozen parameters stay frozen.
        loss_chunk_tokens: most tokens per cross-entropy chunk in the head (bounds the fp32 logits held at once;
            see [Note: loss chunk size] in `head.py`).
        head_shards: the head as this many pipeline layers, one per vocabulary shard ([Note: vocabulary shards]
            in `vocab_shards.py`); 1 keeps one `CausalLMHead`.

    The layers share modules with `model` (no weights are copied). HF gradient checkpointing is switched off on the
    model, since the engine recomputes activations itself. Raises `UnsupportedModelError` naming what is missing.
    """
    refuse_if_not_a_causal_lm(model)  # [Note: causal LMs only] in model_kind.py
    refuse_if_not_matching(model)  # [Note: families that do not match HF]
    parts = find_decoder_parts(model)
    family = family_for(parts.causal_lm)
    _disable_hf_gradient_checkpointing(parts.causal_lm)

    causal_lm = parts.causal_lm
    router_top_k = router_coef = router_experts = None
    router_logits_in_output = False
    if family.switch_router_aux_loss and getattr(causal_lm.config, "output_router_logits", False):
        router_logits_in_output = not install_router_hooks(parts.inner, parts.decoder_layers)
        router_top_k = causal_lm.num_experts_per_tok
        router_coef = float(causal_lm.router_aux_loss_coef)
        router_experts = causal_lm.num_experts

    stubs = decoder_stubs(parts.decoder_layers)
    first = EmbeddingLayer(_inner_shell(parts, stubs, keep_embed=True))
    middle = [
        DecoderLayer(layer, _inner_shell(parts, stubs, keep_embed=False), index, router_top_k, router_logits_in_output)
        for index, layer in enumerate(parts.decoder_layers)
    ]
    head = CausalLMHead(
        _causal_lm_shell(parts),
        lm_head_name=parts.lm_head_name,
        logits_kwargs=_logits_kwargs(causal_lm),
        loss_chunk_tokens=loss_chunk_tokens,
        router_aux_loss_coef=router_coef,
    )
    top = [head] if head_shards == 1 else shard_head(head, head_shards)
    return DecoderSplit(
        layers=nn.Sequential(first, *middle, *top),
        family=family,
        router_experts=router_experts,
        source_model=model,
    )


def _parameter_free_children(module: nn.Module, exclude: tuple) -> dict[str, nn.Module]:
    return {
        name: child
        for name, child in module.named_children()
        if name not in exclude and next(child.parameters(), None) is None
    }


def _inner_shell(parts: DecoderParts, stubs: list, keep_embed: bool) -> nn.Module:
    """Shell of the inner model (see [Note: shells]): rotary and other parameter-free parts, stub layers.

    The first layer's shell holds the embedding and the parts run before the decoder layers; a decoder layer's
    shell has shape-only stand-ins for them (see [Note: parts around the decoder layers] in `stand_ins.py`)."""
    around = (parts.embed_name, *parts.before, *parts.after)
    children = _parameter_free_children(parts.inner, exclude=(parts.layers_name, *around))
    plain: dict[str, object] = {parts.layers_name: stubs}
    if keep_embed:
        children[parts.embed_name] = parts.embed
        children.update({name: parts.inner._modules[name] for name in parts.before})
    else:
        plain[parts.embed_name] = UnusedPart(parts.embed_name)
        plain.update({name: ShapeOnlyPart(name, parts.inner._modules[name]) for name in parts.before})
    # A parameter-free part after the layers may run before them too (nanochat's one weightless norm): the shells
    # keep it as it is, it holds nothing.
    free_after = [name for name in parts.after if next(parts.inner._modules[name].parameters(), None) is None]
    children.update({name: parts.inner._modules[name] for name in free_after})
    plain.update({name: UnusedPart(name) for name in parts.after if name not in free_after})
    return make_shell(parts.inner, children, plain)


def _causal_lm_shell(parts: DecoderParts) -> nn.Module:
    """Shell of the causal LM whose inner model is `FinalNorm`: it holds the parts after the decoder layers (see
    `head.py`). Wrappers between the causal LM and the inner model (OPT's `model` around `model.decoder`) become
    shells too, each holding only the next one on the path."""
    final = FinalNorm({name: parts.inner._modules[name] for name in parts.after})
    # The causal LM may read plain attributes of its inner model (Falcon-H1's `lm_head_multiplier`).
    for key, value in vars(parts.inner).items():
        if isinstance(value, PLAIN_ATTRIBUTE_TYPES) and not key.startswith("_") and not hasattr(final, key):
            final.__dict__[key] = value
    modules = [parts.causal_lm]
    for name in parts.inner_path[:-1]:
        modules.append(modules[-1]._modules[name])
    child: nn.Module = final
    for module, name in zip(reversed(modules[1:]), reversed(parts.inner_path[1:])):
        children = _parameter_free_children(module, exclude=(name,))
        children[name] = child
        child = make_shell(module, children, plain={})
    children = _parameter_free_children(parts.causal_lm, exclude=(parts.inner_path[0], parts.lm_head_name))
    children[parts.inner_path[0]] = child
    children[parts.lm_head_name] = parts.lm_head
    return make_shell(parts.causal_lm, children, plain={})


def _logits_kwargs(causal_lm: nn.Module) -> dict:
    # MoE heads would otherwise compute an aux loss from router logits the head shell does not have.
    parameters = inspect.signature(causal_lm.forward).parameters
    return {"output_router_logits": False} if "output_router_logits" in parameters else {}


def _disable_hf_gradient_checkpointing(causal_lm: nn.Module) -> None:
    checkpointed = [module for module in causal_lm.modules() if getattr(module, "gradient_checkpointing", False)]
    if not checkpointed:
        return
    logger.warning(
        "Turning off Hugging Face gradient checkpointing on %s: RoundPipe recomputes activations itself.",
        type(causal_lm).__name__,
    )
    # transformers 5 renamed it (the old name warns); 4.x has only the old one.
    disable = getattr(causal_lm, "activation_checkpointing_disable", None) or getattr(
        causal_lm, "gradient_checkpointing_disable", None
    )
    if disable is not None:
        disable()
    for module in checkpointed:
        module.gradient_checkpointing = False
