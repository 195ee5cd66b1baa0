"""The first layer (embeddings) and the decoder-layer wrappers of a split causal LM.

[Note: decoder batch layout]
Every pipeline layer receives and returns a flat tuple of tensors, each with the micro-batch rows on dim 0:

    (hidden, attention_mask, position_ids, *extras)

- `hidden`: [b, T, H] float; for the first layer, `input_ids` [b, T] (integer) or `inputs_embeds` [b, T, H].
- `attention_mask`: the 2-D padding mask [b, T] as the user gave it (left or right padding), or an empty [b, 0]
  tensor meaning "no mask given" (HF then treats `position_ids` restarts as packed sequences).
- `position_ids`: [b, T] integer, or an empty [b, 0] tensor meaning "the default positions 0..T-1" (HF then
  computes them itself, and an all-ones mask is dropped on the host: see [Note: no device syncs in the model code]
  in `batch.py`).
- `extras` is empty when the batch has no labels: the head then returns logits. With labels it is
  `(labels [b, T], num_items_in_batch [b])`, preceded for MoE families with a router aux loss by
  `(router_counts, router_probs, batch_tokens)` (see [Note: router statistics] in `router_aux.py`). A batch with the
  router statistics but no labels (`prepare_inputs(..., router_statistics=True)`, the eval loss of an MoE model)
  makes the head return `(logits, router_counts, router_probs)`. `(labels [b, T],)` alone
  (`prepare_inputs(..., token_fields=True)`) makes it return the per-token fields of [Note: per-token fields] in
  `token_fields.py`.

Masks, rotary embeddings and the other decoder-layer arguments are recomputed inside each layer from this compact
data by the model's own code (see [Note: shells] in `shell.py`), so no B x T x T tensor ever travels between layers.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ..compat.hf_experts import dispatching_experts, implementation_of, runnable_implementation, set_implementation
from .router_aux import add_router_statistics, recording
from .shell import capture_layer_call

logger = logging.getLogger(__name__)


def optional_mask(attention_mask: torch.Tensor) -> torch.Tensor | None:
    """The mask to hand to HF: None for the [b, 0] "no mask given" form (a shape test, so no device sync)."""
    return None if attention_mask.shape[-1] == 0 else attention_mask


def optional_positions(position_ids: torch.Tensor) -> torch.Tensor | None:
    """The position ids to hand to HF: None for the [b, 0] "default positions" form."""
    return None if position_ids.shape[-1] == 0 else position_ids


class EmbeddingLayer(nn.Module):
    """Layer 0: token ids (or given embeddings) to the hidden state that enters decoder layer 0.

    The hidden state is taken from the model's own forward (`inner` is a shell, see [Note: shells]), so embedding
    scaling done outside the embedding module (Gemma2 in transformers 4.x) is kept.
    """

    def __init__(self, inner_shell: nn.Module):
        super().__init__()
        self.inner = inner_shell

    def forward(self, tokens, attention_mask, position_ids, *extras):
        source = {"inputs_embeds": tokens} if tokens.is_floating_point() else {"input_ids": tokens}
        args, kwargs = capture_layer_call(
            self.inner,
            0,
            attention_mask=optional_mask(attention_mask),
            position_ids=optional_positions(position_ids),
            use_cache=False,
            **source,
        )
        hidden = args[0] if args else kwargs["hidden_states"]
        return (hidden, attention_mask, position_ids, *extras)


# Captured arguments are cached per layer copy only up to this size: the rotary tables of one long sequence (Qwen3 at
# 131,072 tokens: 64 MiB per layer) would otherwise sit on the GPU once per decoder layer, while recomputing them
# costs little beside the layer itself at such lengths.
CAPTURE_CACHE_MAX_BYTES = 16 * 2**20


class DecoderLayer(nn.Module):
    """One HF decoder layer, called with the arguments the model's own forward would give it.

    Args:
        decoder_layer: the HF layer itself (shared with the model, LoRA adapters included).
        inner_shell: a shell of the inner model without embeddings (see [Note: shells]).
        layer_index: the position of `decoder_layer` in the model.
        router_top_k: the router's top-k when this layer must add router statistics (MoE aux loss), else None.
        router_logits_in_output: the router logits come as the last element of the layer's output tuple (older
            MoE families) rather than from hooks on the routers (see `install_router_hooks`).
    """

    def __init__(
        self,
        decoder_layer: nn.Module,
        inner_shell: nn.Module,
        layer_index: int,
        router_top_k: int | None = None,
        router_logits_in_output: bool = False,
    ):
        super().__init__()
        self.decoder_layer = decoder_layer
        self.inner = inner_shell
        self.layer_index = layer_index
        self.router_top_k = router_top_k
        self.router_logits_in_output = router_logits_in_output
        self._captured: dict[tuple, tuple[tuple, dict]] = {}
        # A copy's experts (its own deep copies, through the memo) beside the user's experts they were copied from
        # (shared by every copy, never copied): see [Note: experts implementation of layer copies].
        experts = [module for _, module in dispatching_experts(decoder_layer)]
        self._experts = experts
        self._user_experts = _Shared(tuple(experts))

    def _layer_arguments(self, hidden, attention_mask, position_ids) -> tuple[tuple, dict]:
        """What the model's own forward passes to this decoder layer (see [Note: shells]).

        With the default mask and positions, the arguments depend only on the hidden state's shape, dtype and
        device, so they are captured once and reused: running the model's forward up to this layer (mask
        construction, rotary embeddings, decorators) in every layer of every micro-batch would keep the host, not
        the GPU, the bottleneck. Arguments over `CAPTURE_CACHE_MAX_BYTES` (very long sequences) are not kept."""
        default = attention_mask.shape[-1] == 0 and position_ids.shape[-1] == 0
        key = (tuple(hidden.shape), hidden.dtype, hidden.device)
        if default and key in self._captured:
            return self._captured[key]
        # `hidden` is detached here: the shell only reads its shape, dtype and device (some models also scale it,
        # which must not reach the autograd graph).
        captured = capture_layer_call(
            self.inner,
            self.layer_index,
            inputs_embeds=hidden.detach(),
            attention_mask=optional_mask(attention_mask),
            position_ids=optional_positions(position_ids),
            use_cache=False,
        )
        # The shell's hidden state is replaced in `forward` anyway; dropping it here keeps the cache from holding a
        # micro-batch's activations (one hidden state per layer copy, on the device, for as long as the engine lives).
        args, kwargs = captured
        if "hidden_states" in kwargs:
            captured = (args, {**kwargs, "hidden_states": None})
        else:
            captured = ((None, *args[1:]), kwargs)
        if default and _tensor_bytes(captured) <= CAPTURE_CACHE_MAX_BYTES:
            if len(self._captured) >= 4:
                self._captured.pop(next(iter(self._captured)))
            self._captured[key] = captured
        return captured

    def _select_experts_implementation(self, device: torch.device) -> None:
        """[Note: experts implementation of layer copies]
        transformers 5 runs a MoE layer's experts by the implementation its config names ("grouped_mm" unless the
        user chose another: `from_pretrained(..., experts_implementation=...)`, `model.set_experts_implementation`;
        `compat/hf_experts.py`). A device's layer copy is a deep copy of the layer, config included, made at its
        first run: without this, a choice made after that run never reached the copies. So before every run each
        copy's experts are set to what the user's experts' config names now, made runnable for the weights the copy
        holds: "grouped_mm" has no float64 kernel, so a float64 copy runs the "eager" loop (the same sums; HF's own
        forward fails there). Only the copy's config changes; the user's model is never touched. The layer itself
        (not a copy: the split run directly) runs the user's experts as they are."""
        for copied, user in zip(self._experts, self._user_experts.value):
            if copied is user:
                continue
            weight = next((p for p in copied._parameters.values() if p is not None), None)
            named = implementation_of(user)
            wanted = named if weight is None else runnable_implementation(named, weight.dtype)
            if wanted != named:
                _say_once(named, wanted, weight.dtype, device)
            if implementation_of(copied) != wanted:
                set_implementation(copied, wanted)

    def forward(self, hidden, attention_mask, position_ids, *extras):
        if self._experts:
            self._select_experts_implementation(hidden.device)
        args, kwargs = self._layer_arguments(hidden, attention_mask, position_ids)
        # The real hidden state takes the place of the one the shell saw (dropped from the captured arguments).
        if "hidden_states" in kwargs:
            kwargs = {**kwargs, "hidden_states": hidden}
        else:
            args = (hidden, *args[1:])
        if self.router_top_k is None or not extras:
            return (_hidden_of(self.decoder_layer(*args, **kwargs)), attention_mask, position_ids, *extras)

        with recording() as router_outputs:
            output = self.decoder_layer(*args, **kwargs)
        if self.router_logits_in_output and isinstance(output, tuple) and output[-1] is not None:
            router_outputs.append(output[-1])
        router_counts, router_probs = add_router_statistics(
            router_outputs, attention_mask, extras[0], extras[1], self.router_top_k
        )
        return (_hidden_of(output), attention_mask, position_ids, router_counts, router_probs, *extras[2:])


class _Shared:
    """A value every deep copy of its holder shares (the user's modules, which a layer copy reads, never copies)."""

    __slots__ = ("value",)

    def __init__(self, value) -> None:
        self.value = value

    def __deepcopy__(self, memo) -> _Shared:
        return self


_SAID: set[tuple] = set()


def _say_once(named: str | None, wanted: str | None, dtype: torch.dtype, device: torch.device) -> None:
    key = (named, wanted, dtype, device.type)
    if key not in _SAID:
        _SAID.add(key)
        logger.warning("RoundPipe: the model's config names experts_implementation=%r, which has no %s kernel; the "
                       "layer copies on %s run %r instead (the same computation). Set it to %r on the model "
                       "(model.set_experts_implementation) to say so.", named, dtype, device.type, wanted, wanted)


def _tensor_bytes(captured: tuple[tuple, dict]) -> int:
    """Bytes of the tensors among captured layer arguments (the rotary tables, masks)."""
    return sum(v.nbytes for v in tree_leaves(captured) if isinstance(v, torch.Tensor))


def _hidden_of(layer_output):
    return layer_output[0] if isinstance(layer_output, tuple) else layer_output
