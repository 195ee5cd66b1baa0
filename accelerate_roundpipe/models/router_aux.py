"""The Switch-Transformer router load-balancing loss of HF mixture-of-experts models, computed across a pipeline.

[Note: router statistics]
HF computes `aux = E * sum_e f_e * P_e` over the router outputs of *all* layers at once (`load_balancing_loss_func`):
`f_e` is the share of top-k picks that went to expert e, `P_e` the mean router probability of e, both over every
non-padding token of every MoE layer. A pipeline never holds all layers together, but both are ratios of sums, so
each decoder layer adds its sums to running per-row totals that travel with the hidden state:

- `router_counts` (int64 [B, E + 1]): top-k picks per expert, and in the last column the routed (non-padding) rows;
- `router_probs` (float [B, E], at least fp32): router probabilities per expert, summed over non-padding tokens.
  This one carries gradient back to every router (it is the only float pass-through besides the hidden state);
- `batch_tokens` (int64 [B]): the non-padding tokens of the whole batch, the same in every row.

The head turns the totals of its micro-batch into that micro-batch's aux loss. The loss is a product of two batch
means, so it does not split into a sum over micro-batches: with one micro-batch it equals HF's exactly; with several,
the head weights each micro-batch's aux by its share of the batch's tokens, so the sum over micro-batches is the
token-weighted mean of per-micro-batch aux losses (each micro-batch balances its own experts).
"""

from __future__ import annotations

import contextvars
import functools

import torch
from torch import nn

from .errors import UnsupportedModelError

_records: contextvars.ContextVar[list | None] = contextvars.ContextVar("roundpipe_router_records", default=None)


@functools.cache
def _router_specs(inner_class: type) -> tuple:
    """`_can_record_outputs["router_logits"]` of the inner model class, as (target_class, class_name, index, name)."""
    specs = getattr(inner_class, "_can_record_outputs", None) or {}
    specs = specs.get("router_logits")
    if specs is None:
        return ()
    result = []
    for spec in specs if isinstance(specs, list) else [specs]:
        if isinstance(spec, (type, str)):  # HF's default index for a bare class is 1 for everything but hidden states
            result.append((spec if isinstance(spec, type) else None, spec if isinstance(spec, str) else None, 1, None))
        else:
            result.append((spec.target_class, spec.class_name, spec.index, spec.layer_name))
    return tuple(result)


def _record_router_output(module, args, output, *, index: int) -> None:
    records = _records.get()
    if records is not None:
        records.append(output[index] if isinstance(output, tuple) else output)


def install_router_hooks(inner: nn.Module, decoder_layers: nn.ModuleList) -> bool:
    """Put a recording forward hook on every router module in the decoder layers (once; inert outside `recording`).

    The routers are found the way HF finds them for `output_router_logits`, from the inner model's
    `_can_record_outputs["router_logits"]`. Returns False when the model declares none: older families
    (transformers 4.x Qwen2-MoE, OLMoE) return the router logits as the last element of each decoder layer's output
    instead, when called with `output_router_logits=True`.
    """
    specs = _router_specs(type(inner))
    if not specs:
        return False
    found = 0
    for layer_index, layer in enumerate(decoder_layers):
        for name, module in layer.named_modules(prefix=f"layers.{layer_index}"):
            for target_class, class_name, index, layer_name in specs:
                matches = (target_class is not None and isinstance(module, target_class)) or (
                    class_name is not None and name.endswith(class_name)
                )
                if not matches or (layer_name is not None and f".{layer_name.strip('.')}." not in f".{name}."):
                    continue
                found += 1
                hooks = module._forward_hooks.values()
                if not any(getattr(hook, "func", None) is _record_router_output for hook in hooks):
                    module.register_forward_hook(functools.partial(_record_router_output, index=index))
    if found == 0:
        raise UnsupportedModelError(
            inner,
            "no router module named by `_can_record_outputs['router_logits']` was found in the decoder layers; "
            "set `config.output_router_logits = False` to train without the router auxiliary loss",
        )
    return True


class recording:
    """Context manager collecting, in this thread only, the router outputs of the modules hooked above."""

    def __enter__(self) -> list:
        self.outputs = []
        self._token = _records.set(self.outputs)
        return self.outputs

    def __exit__(self, *exc) -> None:
        _records.reset(self._token)


def add_router_statistics(
    router_outputs: list[torch.Tensor],
    attention_mask: torch.Tensor,
    router_counts: torch.Tensor,
    router_probs: torch.Tensor,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """New running totals after one decoder layer (see [Note: router statistics]); inputs are not modified.

    `attention_mask` is [b, T] (or [b, 0] for "no mask": every token counts). Router outputs are [b * T, E] in
    row-major (row, token) order, as HF's routers produce them from `hidden.reshape(-1, H)`.
    """
    num_rows = router_counts.shape[0]
    num_experts = router_probs.shape[1]
    for logits in router_outputs:
        logits = logits.reshape(num_rows, -1, num_experts)
        weights = torch.softmax(logits.to(router_probs.dtype), dim=-1)
        picks = torch.topk(weights, top_k, dim=-1).indices
        if attention_mask.shape[1] == 0:
            token_mask = torch.ones(logits.shape[:2], dtype=torch.int64, device=logits.device)
        else:
            token_mask = attention_mask.to(torch.int64)
        picked = nn.functional.one_hot(picks, num_experts).sum(dim=-2) * token_mask[..., None]
        counts = torch.cat([picked.sum(dim=1), token_mask.sum(dim=1, keepdim=True)], dim=1)
        router_counts = router_counts + counts
        router_probs = router_probs + (weights * token_mask[..., None].to(weights.dtype)).sum(dim=1)
    return router_counts, router_probs


def router_aux_loss(
    router_counts: torch.Tensor,
    router_probs: torch.Tensor,
    batch_tokens: torch.Tensor,
    micro_batch_tokens: torch.Tensor,
) -> torch.Tensor:
    """This micro-batch's share of the aux loss (see [Note: router statistics]), before `router_aux_loss_coef`."""
    aux = batch_router_aux_loss(router_counts, router_probs)
    return aux * (micro_batch_tokens.to(aux.dtype) / batch_tokens[0].to(aux.dtype))


def with_router_aux_loss(loss: torch.Tensor, coef: float | None, extras: tuple, attention_mask: torch.Tensor,
                         labels: torch.Tensor) -> torch.Tensor:
    """`loss` plus `coef` times this micro-batch's aux loss, from the router statistics that lead a head's extras
    (`router_counts, router_probs, batch_tokens, ...`); `loss` itself without a coefficient."""
    if coef is None:
        return loss
    router_counts, router_probs, batch_tokens = extras[:3]
    micro_batch_tokens = attention_mask.sum() if attention_mask.shape[1] else labels.new_tensor(labels.numel())
    aux = router_aux_loss(router_counts, router_probs, batch_tokens, micro_batch_tokens)
    return loss + coef * aux.to(loss.dtype)


def batch_router_aux_loss(router_counts: torch.Tensor, router_probs: torch.Tensor) -> torch.Tensor:
    """HF's aux loss (before `router_aux_loss_coef`) of the rows whose running totals are given."""
    num_experts = router_probs.shape[1]
    totals = router_counts.sum(dim=0).to(router_probs.dtype)
    # A micro-batch of padding only (an empty example) routes no row: its picks and probabilities are all zero, and
    # so is its aux loss (its share of the batch's tokens is zero too), not 0 / 0.
    routed_rows = totals[num_experts].clamp(min=1)
    picks_per_expert = totals[:num_experts] / routed_rows
    prob_per_expert = router_probs.sum(dim=0) / routed_rows
    return num_experts * torch.sum(picks_per_expert * prob_per_expert)
