"""`wrap_model`: a Hugging Face causal LM (plain or PEFT) on the RoundPipe engine, keeping the user's object.

`engine.module` is the user's model itself (same object, class, `config`, `save_pretrained`); its instance `forward`
is patched to route through the engine, so code holding the model keeps working:

- train mode, grad enabled, `labels` given: the fused pipelined forward + backward, returning a loss whose
  `backward()` commits the gradients ([Note: deferred gradient commit]); `logits` is None (never materialised);
- eval mode or no grad: a forward-only pipeline returning `logits` (and `loss` when `labels` are given);
- grad enabled without labels: `logits` attached to the backward pipeline;
- `fused_lm_head=True` with `labels` (TRL's fused LM head, `trl.trainer.utils.add_fused_lm_head`): the labels'
  per-token log-probabilities, entropies and the rest of TRL's `FusedCausalLMOutput`, computed in the pipeline's
  head without the logits ever leaving it ([Note: per-token fields] in `token_fields.py`), attached to the backward
  pipeline when grad is enabled.

[Note: the model's own loss function]
HF's causal-LM forwards compute `loss = self.loss_function(logits=logits, labels=labels, vocab_size=..., **kwargs)`;
the pipeline's head computes transformers' `ForCausalLMLoss` fused, without the logits. When the model's loss
function is another one (`model.loss_function = fn`, a `model.loss_type` naming another `LOSS_MAPPING` entry, a
replaced `LOSS_MAPPING["ForCausalLM"]`, a subclass's `loss_function`: `compat.hf_models.own_loss_function`, read on
every call, so a function set after wrapping counts), a call with `labels` takes the logits path instead: the logits
of the whole batch (attached to the backward pipeline when grad is enabled), and that function called on them on the
host as Llama's forward calls it, `fn(logits=logits, labels=labels, vocab_size=logits.shape[-1])` plus
`num_items_in_batch` when given, the router aux loss of MoE models added as HF adds it. Exact (the same loss and
gradients as the plain model), slower: the whole batch's logits are made and downloaded. Under data parallelism
that loss is this rank's, as under DDP ([Note: data-parallel loss scaling]). `forward_backward` does the same on one
process; with several it refuses (its loss is the global batch's, which only the head's loss gives). A class whose
`forward` overrides the transformers class's (`forward_override`) is refused when wrapped: the engine never calls
it, so what it changes would be lost.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
from torch import nn

from ..compat.hf_models import (
    SavePretrainedCall,
    class_method,
    forward_override,
    has_transformers_adapters,
    own_loss_function,
    patch_methods,
    restore_methods,
    save_pretrained_call,
)
from ..compat.trl_internals import fused_head_setting, fused_output_class
from ..config import RoundPipeConfig
from ..runtime.engine.engine import RoundPipe
from ..runtime.engine.saved_weights import model_dtype, model_dtype_state_dict
from .errors import UnsupportedModelError
from .kernels import apply_fused_kernels
from .parts import unwrap_peft
from .router_aux import batch_router_aux_loss
from .split import DEFAULT_LOSS_CHUNK_TOKENS, split_causal_lm
from .tiled_mlp import tile_mlps
from .token_fields import FIELDS, IGNORE_INDEX
from .vocab_shards import resolve_head_shards

# Keyword arguments of an HF forward the pipeline accepts when they ask for nothing it would have to do differently.
_IGNORED_WHEN_FALSY = ("past_key_values", "output_attentions", "output_hidden_states", "output_router_logits",
                       "logits_to_keep", "num_logits_to_keep")
_IGNORED = ("use_cache", "return_dict", "token_type_ids")
# What a padding-free collator (TRL's `padding_free`, `packing=True`; HF's `DataCollatorWithFlattening`) adds beside
# the restarting `position_ids` for flash attention: the same packing, which the pipeline reads from the positions.
_PACKING_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def _check_packing_kwargs(packing: dict[str, Any], position_ids) -> None:
    """Flash attention's description of packed sequences is dropped: the pipeline packs by `position_ids` (each
    sequence's ids restart at 0), as HF does without flash attention. Refused when it says another packing."""
    if position_ids is None:
        raise ValueError(f"{sorted(packing)} describe packed sequences, but no `position_ids` came with them: the "
                         f"RoundPipe engine reads the packing from `position_ids` (restarting at 0 for each "
                         f"sequence); pass them too.")
    positions = torch.as_tensor(position_ids).reshape(-1).cpu()
    starts = (positions == 0).nonzero().reshape(-1)
    bounds = torch.cat([starts, torch.tensor([positions.numel()])])
    expected = {"cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds,
                "max_length_q": int((bounds[1:] - bounds[:-1]).max()) if len(starts) else 0,
                "seq_idx": torch.cumsum(positions == 0, 0) - 1}
    expected["max_length_k"] = expected["max_length_q"]
    for key, value in packing.items():
        want = expected[key]
        agrees = (int(value) == want if not torch.is_tensor(value) or value.dim() == 0 else
                  torch.equal(value.reshape(-1).cpu().long(), want.long()))
        if not agrees:
            raise ValueError(f"`{key}` describes another packing than `position_ids` (sequences starting at "
                             f"{starts.tolist()}): the RoundPipe engine reads the packing from `position_ids` "
                             f"alone (restarting at 0 for each sequence); make them agree, or leave `{key}` out.")


def _causal_lm_output(loss, logits, aux_loss=None):
    """HF's output of a causal LM; of a mixture-of-experts one (`aux_loss`, the router aux loss before
    `router_aux_loss_coef`, as HF's MoE models return it) where the engine computed its router aux loss."""
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

    if aux_loss is not None:
        return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux_loss, logits=logits)
    return CausalLMOutputWithPast(loss=loss, logits=logits)


def refuse_forward_override(model: nn.Module) -> None:
    """Refuse a model whose class overrides its transformers class's `forward`
    ([Note: the model's own loss function])."""
    override = forward_override(unwrap_peft(model))
    if override is not None:
        raise UnsupportedModelError(model, (
            f"{override}, and RoundPipe never calls it: the engine runs the decoder layers and the loss itself, so "
            f"what that forward changes (its loss, its logits) would be silently lost. Compute a custom loss from "
            f"the logits instead, where RoundPipe honours it: `model.loss_function = fn` (called as "
            f"`fn(logits=..., labels=..., vocab_size=..., num_items_in_batch=...)`), the Trainer's "
            f"`compute_loss_func`, or a `compute_loss` override calling `model(**inputs)`; and train the "
            f"transformers class itself"))


def model_loss(loss_function, logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
    """The model's loss from the whole batch's logits: HF's causal-LM loss when `loss_function` is None, else the
    model's own loss function, called as Llama's forward calls it ([Note: the model's own loss function])."""
    if loss_function is None:
        return causal_lm_loss(logits, labels, num_items_in_batch)
    counted = {} if num_items_in_batch is None else {"num_items_in_batch": num_items_in_batch}
    return loss_function(logits=logits, labels=labels, vocab_size=logits.shape[-1], **counted)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
    """HF's causal-LM loss (shift, ignore -100, mean over label tokens or sum / `num_items_in_batch`)."""
    shift_logits = logits[:, :-1, :].float().flatten(0, 1)
    shift_labels = labels[:, 1:].to(shift_logits.device).flatten()
    total = nn.functional.cross_entropy(shift_logits, shift_labels, ignore_index=-100, reduction="sum")
    count = num_items_in_batch if num_items_in_batch is not None else (shift_labels != -100).sum()
    return total / count


class CausalLMRoundPipe(RoundPipe):
    """RoundPipe over a Hugging Face causal LM; build it with `wrap_model(model, config)`."""

    def __init__(self, model: nn.Module, config: RoundPipeConfig | None = None, *,
                 loss_chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS, allow_short_batches: bool = False) -> None:
        config = config if config is not None else RoundPipeConfig()
        refuse_forward_override(model)
        kernels_applied = apply_fused_kernels(model, config.resolved_kernels, config.resolved_devices())
        split = split_causal_lm(model, loss_chunk_tokens=loss_chunk_tokens,
                                head_shards=resolve_head_shards(config, getattr(model, "config", None)))
        if config.mlp_chunk_tokens is not None:
            tile_mlps([layer.decoder_layer for layer in split.layers if hasattr(layer, "decoder_layer")],
                      config.mlp_chunk_tokens)
        super().__init__(model, config, layers=split.layers, allow_short_batches=allow_short_batches)
        object.__setattr__(self, "split", split)
        self.fused_kernels = kernels_applied  # Liger kernels applied to the decoder layers (see models/kernels.py)
        self.train(model.training)
        # The user's object keeps its identity; its methods route through the engine
        # ([Note: compatibility reaches]).
        self._originals = patch_methods(model, {
            "forward": self._hf_forward,
            "generate": functools.partial(self._generate, class_method(model, "generate")),
            "save_pretrained": self._save_pretrained,
            # The model's own parameters never hold gradients (they live on `parameters()`, the optimizer copies):
            # `nn.Module.zero_grad` would clear nothing, and a loop zeroing through the model would accumulate
            # every step's gradients silently. The engine's clears them in order with the pending steps.
            "zero_grad": self._zero_grad_of_model,
            "state_dict": functools.partial(self._state_dict, class_method(model, "state_dict"))})

    def _zero_grad_of_model(self, set_to_none: bool = True) -> None:
        """`model.zero_grad(set_to_none=...)` on the wrapped model: the engine's `zero_grad`."""
        self.zero_grad(set_to_none=set_to_none)

    # ------------------------------------------------------------------ engine API with HF batches

    def forward_backward(self, *args: Any, labels: torch.Tensor | None = None, loss_fn=None,
                         loss_reduction: str | None = None, grad_scale: float = 1.0, deferred: bool = False,
                         **batch: Any) -> torch.Tensor:
        """The fused pass over an HF batch (`input_ids`, `attention_mask`, `labels`, ...): returns the model's own
        loss (mean over the label tokens of the whole batch, or sum / `num_items_in_batch`)."""
        if args or loss_fn is not None or loss_reduction is not None:
            raise TypeError("a wrapped Hugging Face model takes the batch as keyword arguments (input_ids=..., "
                            "labels=..., ...) and computes its own loss; loss_fn/loss_reduction do not apply.")
        if labels is None:
            raise ValueError("forward_backward needs `labels` in the batch (the model's loss is computed from them).")
        loss_function = self.custom_loss_function()
        if loss_function is not None:
            return self._own_loss_forward_backward(loss_function, labels, batch, grad_scale, deferred)
        batch = self._model_inputs(batch)
        batch_tokens = self._global_counts(batch, labels)
        inputs = self.split.prepare_inputs(labels=labels, batch_tokens=batch_tokens, **batch)
        return super().forward_backward(*inputs, loss_reduction="sum", grad_scale=grad_scale, deferred=deferred)

    def custom_loss_function(self):
        """The model's own loss function when the pipeline's head does not compute it, else None; read on every
        call ([Note: the model's own loss function])."""
        return own_loss_function(unwrap_peft(self.split.source_model))

    def _own_loss_forward_backward(self, loss_function, labels, batch: dict[str, Any], grad_scale: float,
                                   deferred: bool) -> torch.Tensor:
        """`forward_backward` of a model with its own loss function: the logits path's loss, back-propagated
        ([Note: the model's own loss function])."""
        if self.data_parallel is not None:
            name = getattr(loss_function, "__qualname__", None) or repr(loss_function)
            raise ValueError(
                f"the model's loss function is {name} (set through `model.loss_function` or `model.loss_type`), not "
                f"transformers' ForCausalLMLoss, and with several processes `forward_backward` returns the loss of "
                f"the global batch, which RoundPipe computes only for ForCausalLMLoss. Call `model(**batch)` and "
                f"back-propagate its `.loss` (`accelerator.backward(loss)`): it is computed from this rank's logits "
                f"by your function, as under DDP.")
        loss = self._hf_forward(labels=labels, **batch).loss
        if deferred:
            return loss
        (loss * grad_scale).backward()
        return loss.detach()

    def _global_counts(self, batch: dict[str, Any], labels: torch.Tensor) -> int | None:
        """What a loss is normalised by counts the GLOBAL batch: the label tokens (HF's `num_items_in_batch`, unless
        the caller gave it: then it is the global count already) and, for a router aux loss, the non-padding tokens
        ([Note: router statistics]; else each rank's aux would count in full and the sum over ranks be world_size
        times HF's). Summed by the engine's gradient exchange ([Note: gradient exchange]): over the ranks under data
        parallelism ([Note: data parallel]), this batch's own counts on one process. Returns the token count when
        the model has a router aux loss."""
        has_router_aux = self.split.router_experts is not None
        if batch.get("num_items_in_batch") is not None and not has_router_aux:
            return None  # nothing to count: the caller's count is the global one
        local_items = float((labels[:, 1:] != IGNORE_INDEX).sum())
        local_tokens = 0.0
        if has_router_aux:
            tokens = batch.get("input_ids", batch.get("inputs_embeds"))
            mask = batch.get("attention_mask")
            local_tokens = float(mask.sum()) if mask is not None and mask.shape[1] else \
                float(tokens.shape[0] * tokens.shape[1])
        items, tokens = self.sum_over_ranks(
            [local_items, local_tokens], "the all-reduce of the label and token counts of the global batch")
        if batch.get("num_items_in_batch") is None:
            batch["num_items_in_batch"] = torch.tensor(int(items))
        return int(tokens) if has_router_aux else None

    def _model_inputs(self, batch: dict[str, Any]) -> dict[str, Any]:
        known = ("input_ids", "attention_mask", "position_ids", "inputs_embeds", "num_items_in_batch")
        out = {k: batch.pop(k) for k in known if k in batch}
        cache_position = batch.pop("cache_position", None)
        if cache_position is not None:
            # generate() in transformers 4.x passes the positions of the whole sequence even without a cache: fine,
            # that is what the pipeline computes; anything else would need a KV cache.
            tokens = out.get("input_ids", out.get("inputs_embeds"))
            length = tokens.shape[1] if tokens is not None else -1
            if not torch.equal(cache_position.cpu(), torch.arange(length)):
                raise ValueError("`cache_position` other than 0..seq_len-1 needs a KV cache, which the RoundPipe "
                                 "engine does not keep; leave it unset (generate() works with use_cache=False).")
        packing = {key: batch.pop(key) for key in _PACKING_KWARGS if batch.get(key) is not None}
        if packing:
            _check_packing_kwargs(packing, out.get("position_ids"))
        for key in _IGNORED:
            batch.pop(key, None)
        self._check_router_aux_switch(batch.pop("output_router_logits", None))
        for key in _IGNORED_WHEN_FALSY:
            value = batch.pop(key, None)
            if value is not None and value is not False and not (isinstance(value, int) and value == 0):
                raise ValueError(f"`{key}={value!r}` is not supported by the RoundPipe engine (it runs without a "
                                 f"KV cache and returns loss/logits only); leave it unset.")
        if batch:
            raise TypeError(f"unexpected batch keys for the RoundPipe engine: {sorted(batch)}.")
        return out

    def _check_router_aux_switch(self, given) -> None:
        """[Note: router aux loss fixed at wrap]
        HF decides at every forward whether to add the router aux loss (the call's `output_router_logits`, else
        `config.output_router_logits`) and with which weight (the model's `router_aux_loss_coef`). The split decides
        once, in `wrap_model` (its layers carry router statistics and its head adds the aux loss with the weight
        read then), so a call or a setting asking otherwise would get a loss other than HF's, silently: refused,
        naming what to change. `output_router_logits=True` is refused too: the pipeline returns no router logits or
        `aux_loss` (its `loss` already includes the aux loss when the config asked for it at wrap)."""
        model = unwrap_peft(self.split.source_model)
        config = getattr(model, "config", None)
        adds = self.split.router_experts is not None
        if not (adds or (self.split.family.switch_router_aux_loss and hasattr(model, "router_aux_loss_coef"))):
            if given is not None and given is not False and not (isinstance(given, int) and given == 0):
                raise ValueError(f"`output_router_logits={given!r}` is not supported by the RoundPipe engine (it "
                                 f"returns loss/logits only); leave it unset.")
            return
        at_wrap = (f"when the model was wrapped, config.output_router_logits was {adds}, so RoundPipe "
                   f"{'adds' if adds else 'does not add'} the router aux loss to every loss (decided once, in "
                   f"wrap_model)")
        if given is not None and bool(given):
            raise ValueError(f"`output_router_logits=True` is not supported by the RoundPipe engine: it returns no "
                             f"router logits or `aux_loss`; {at_wrap}. Leave `output_router_logits` unset.")
        wanted = bool(getattr(config, "output_router_logits", False)) if given is None else False
        if wanted != adds:
            asked = ("this call passes `output_router_logits=False`" if given is not None else
                     f"config.output_router_logits is {wanted} now")
            raise ValueError(f"{asked}, but {at_wrap}: HF's loss would {'include' if wanted else 'leave out'} the "
                             f"aux loss and RoundPipe's would not. Set config.output_router_logits before wrap_model "
                             f"(close the engine and wrap the model again to change it), and do not pass "
                             f"`output_router_logits` to the forward.")
        if adds:
            coef = float(model.router_aux_loss_coef)
            at_wrap_coef = self.split.layers[-1].router_aux_loss_coef
            if coef != at_wrap_coef:
                raise ValueError(f"the model's router_aux_loss_coef is {coef} now, but it was {at_wrap_coef} when the "
                                 f"model was wrapped, and RoundPipe's loss head adds the aux loss with that weight "
                                 f"(decided once, in wrap_model). Set router_aux_loss_coef before wrap_model (close "
                                 f"the engine and wrap the model again to change it).")

    # ------------------------------------------------------------------ the patched model

    def _hf_forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, inputs_embeds=None,
                    num_items_in_batch=None, fused_lm_head=False, shift_labels=None, skip_logits=None, **kwargs):
        batch = self._model_inputs(dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                        inputs_embeds=inputs_embeds, **kwargs))
        if fused_lm_head or shift_labels is not None:
            return self._fused_lm_head_output(batch, labels, shift_labels, num_items_in_batch)
        # A loss function of the model's own takes the logits path ([Note: the model's own loss function]).
        loss_function = self.custom_loss_function() if labels is not None else None
        fused = labels is not None and loss_function is None
        if fused and self.module.training and torch.is_grad_enabled():
            loss = self.forward_backward(labels=labels, num_items_in_batch=num_items_in_batch, deferred=True, **batch)
            return _causal_lm_output(loss, None)
        # HF adds the router aux loss of MoE models to the loss (in eval too) and returns it as `aux_loss` (without
        # labels too, for a loss of the caller's own): carry the router statistics then.
        router_aux = self.split.router_experts is not None
        if skip_logits and fused and not router_aux and not torch.is_grad_enabled():
            return _causal_lm_output(self._evaluation_loss(batch, labels, num_items_in_batch), None)
        output = self(*self.split.prepare_inputs(**batch, router_statistics=router_aux))
        logits = output[0] if router_aux else output
        loss = model_loss(loss_function, logits, labels, num_items_in_batch) if labels is not None else None
        aux = batch_router_aux_loss(output[1], output[2]) if router_aux else None
        if aux is not None and loss is not None:
            loss = loss + self.split.layers[-1].router_aux_loss_coef * aux.to(loss.device, loss.dtype)
        return _causal_lm_output(loss, logits, aux)

    def _evaluation_loss(self, batch: dict[str, Any], labels: torch.Tensor, num_items_in_batch) -> torch.Tensor:
        """[Note: evaluation loss]
        `model(**batch, labels=labels, skip_logits=True)` without gradients (HF's name for "the loss only", which
        the Trainer passes with Liger kernels, and `RoundPipeTrainer.prediction_step` whenever only the loss is
        wanted): the pipeline's head computes the loss as in training (the fused cross-entropy over token chunks,
        on the device) and returns it alone, so the logits of the batch (tokens x vocabulary) are never made,
        downloaded or reduced on the host. The same loss as the logits path (`causal_lm_loss`) to rounding: the sum
        over the label tokens over `num_items_in_batch`, else over this batch's label count. Models with a router
        aux loss keep the logits path: its statistics are the whole batch's there ([Note: router statistics])."""
        if num_items_in_batch is None:
            num_items_in_batch = int((labels[:, 1:] != IGNORE_INDEX).sum())
        return self.forward_loss(*self.split.prepare_inputs(labels=labels, num_items_in_batch=num_items_in_batch,
                                                            **batch))

    def _fused_lm_head_output(self, batch: dict[str, Any], labels, shift_labels, num_items_in_batch):
        """What TRL's fused LM head returns for `model(**batch, labels=labels, fused_lm_head=True)`, computed by the
        pipeline ([Note: per-token fields])."""
        if shift_labels is not None:
            raise ValueError("`shift_labels` (pre-shifted labels, from context or sequence parallelism) is not "
                             "supported by the RoundPipe engine, which replaces those; pass unshifted `labels`.")
        if labels is None:
            raise ValueError("`fused_lm_head=True` needs `labels`: the tokens whose log-probabilities are wanted.")
        temperature = fused_head_setting(self.module, self._originals.get("forward"), "temperature", 1.0)
        if temperature != 1.0:
            raise ValueError(f"TRL's fused LM head was added with temperature={temperature}; the RoundPipe engine "
                             f"computes log-probabilities at temperature 1 only (SFT and DPO use 1).")
        fields = self(*self.split.prepare_inputs(labels=labels, token_fields=True, **batch))[:, :-1]
        mask = labels[:, 1:] != IGNORE_INDEX
        per_token = dict(zip(FIELDS, fields.unbind(-1)))
        per_token["is_top1"] = per_token["is_top1"].bool()
        count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return fused_output_class()(loss=-per_token["log_probs"].sum() / count, label_mask=mask, **per_token)

    def _generate(self, original_generate, *args, **kwargs):
        # The pipeline keeps no KV cache: every new token reruns the whole sequence (see docs: generation).
        kwargs["use_cache"] = False
        return original_generate(*args, **kwargs)

    def _state_dict(self, original_state_dict, *args, **kwargs):
        """The model's own `state_dict`, after a look: it shows the newest weights, as `engine.state_dict()` and the
        plain model after `optimizer.step()` do. Before, `torch.save(model.state_dict(), ...)` right after a step
        (or PEFT's `get_peft_model_state_dict(model)`, which calls it) read the compute copies as the last look left
        them: the initial weights in a loop that never synchronized. A look changes no step
        ([Note: looking changes nothing]). A failed engine is not waited for: reading its module says whether the
        weights are torn ([Note: torn weights])."""
        if self._failure.error is None and not self.closed:
            self.synchronize()
        return original_state_dict(*args, **kwargs)

    def _save_pretrained(self, *args, **kwargs):
        """The model's own `save_pretrained`, after the lagged step is flushed, writing the model in its own dtype
        from the optimizer copies, not the narrower compute copies ([Note: saved model dtype])."""
        self.synchronize()
        call: SavePretrainedCall = save_pretrained_call(self.module, args, kwargs)
        if not call.gives_state_dict and not call.state_dict_positional:  # the caller's own is saved as given
            kwargs["state_dict"] = model_dtype_state_dict(self)
        result = type(self.module).save_pretrained(self.module, *args, **kwargs)
        self._config_shows_model_dtype(call.save_directory, call.is_main_process)
        return result

    def _config_shows_model_dtype(self, directory, is_main_process) -> None:
        """HF's `save_pretrained` sets `config.dtype` from the parameters, i.e. the compute copies: say the model's
        own dtype instead, in memory and in the `config.json` it wrote."""
        from transformers import PreTrainedModel

        model, dtype = self.module, model_dtype(self)
        config = getattr(model, "config", None)
        if not isinstance(model, PreTrainedModel) or dtype is None or config is None:
            return  # PEFT writes no dtype (adapter weights only)
        name = str(dtype).removeprefix("torch.")
        if getattr(config, "dtype", None) == name:
            return
        config.dtype = name
        written = os.path.join(os.fspath(directory), "config.json") if directory is not None else None
        if is_main_process and written and os.path.isfile(written) and not has_transformers_adapters(model):
            config.save_pretrained(directory)

    def close(self) -> None:
        """Stop the engine and give the model back its own forward, generate, save_pretrained, zero_grad and
        state_dict."""
        try:
            super().close()
        finally:
            # not `self.module`: refused when a failure tore the weights
            restore_methods(self._modules["module"], self._originals)


def wrap_model(model: nn.Module, config: RoundPipeConfig | None = None, **kwargs: Any) -> CausalLMRoundPipe:
    """Put a Hugging Face causal LM (or a `peft.PeftModel` around one) on RoundPipe.

    Returns the engine; `engine.module` is `model` itself, whose `forward` now routes through the engine. The model
    is never moved to a GPU: its weights become views of the engine's host store. Raises `UnsupportedModelError`
    for models it cannot split (use `RoundPipe(torch.nn.Sequential(...))` for those).
    """
    if isinstance(model, RoundPipe):
        return model
    return CausalLMRoundPipe(model, config, **kwargs)
