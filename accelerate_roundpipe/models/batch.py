"""Turn HF-style model inputs into the batch tuple the first pipeline layer takes ([Note: decoder batch layout])."""

from __future__ import annotations

import torch

from .head import IGNORE_INDEX


def build_batch(
    *,
    input_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    labels: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
    num_items_in_batch: int | torch.Tensor | None,
    router_experts: int | None,
    router_probs_dtype: torch.dtype,
    router_statistics: bool = False,
    token_fields: bool = False,
    batch_tokens: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """The whole batch as a tuple of tensors with rows on dim 0, ready to be split into micro-batches.

    Everything that depends on the whole batch is computed here, before the split, and stored once per row:
    `num_items_in_batch` (HF's, else the labels != -100 after the shift) and, for router aux losses, the batch's
    non-padding token count (`batch_tokens` when given: under data parallelism, the global batch's). `router_experts`
    is the expert count when router statistics must be carried: always
    with labels, and without labels when `router_statistics` is true (the head then returns them with the logits).
    `token_fields=True` carries the labels alone: the head then returns their per-token log-probabilities
    ([Note: per-token fields] in `token_fields.py`).
    """
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("Pass exactly one of `input_ids` and `inputs_embeds` to `prepare_inputs`.")
    tokens = input_ids if input_ids is not None else inputs_embeds
    if tokens.dim() < 2:
        raise ValueError(
            f"`input_ids`/`inputs_embeds` must be batched ([batch, seq, ...]); got shape {tuple(tokens.shape)}."
        )
    num_rows, seq_len = tokens.shape[:2]
    device = tokens.device

    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(
            f"`attention_mask` must be the 2-D padding mask [batch, seq]; got shape {tuple(attention_mask.shape)}. "
            "4-D masks are rebuilt inside each layer and cannot be passed in."
        )
    if _is_all_ones_on_host(attention_mask) and position_ids is None:
        # [Note: no device syncs in the model code]
        # HF's mask code tests `padding_mask.all()` and, without a mask, looks for packed sequences in
        # `position_ids`: both synchronise the GPU in every layer of every micro-batch. An all-ones mask with default
        # positions means plain causal attention, so both are left out here, on the host, where the test is free;
        # the model's own code then takes its `is_causal` path.
        attention_mask = None
    if attention_mask is None:
        attention_mask = torch.zeros(num_rows, 0, dtype=torch.int64, device=device)  # "no mask given"
    if position_ids is None:
        position_ids = torch.zeros(num_rows, 0, dtype=torch.int64, device=device)  # "default positions 0..T-1"
    else:
        position_ids = position_ids.expand(num_rows, seq_len).contiguous()

    batch = (tokens, attention_mask, position_ids)
    if token_fields:
        if labels is None:
            raise ValueError("`token_fields=True` needs `labels` (the tokens whose log-probabilities are wanted).")
        if router_experts is not None:
            raise ValueError("per-token log-probabilities (TRL's fused LM head) are not supported for mixture-of-"
                             "experts models with a router aux loss yet; set `output_router_logits=False` in the "
                             "model config (TRL: `router_aux_loss_coef=0.0`).")
        return batch + (labels,)
    if labels is None and not (router_statistics and router_experts is not None):
        return batch

    if router_experts is not None:
        if batch_tokens is None:
            batch_tokens = attention_mask.sum() if attention_mask.shape[1] else torch.tensor(num_rows * seq_len)
        batch_tokens = torch.as_tensor(batch_tokens)
        batch += (
            torch.zeros(num_rows, router_experts + 1, dtype=torch.int64, device=device),
            torch.zeros(num_rows, router_experts, dtype=router_probs_dtype, device=device),
            batch_tokens.to(device=device, dtype=torch.int64).expand(num_rows).contiguous(),
        )
    if labels is None:
        return batch
    return batch + (labels, _num_items_per_row(labels, num_items_in_batch, num_rows))


def _is_all_ones_on_host(mask: torch.Tensor | None) -> bool:
    return mask is not None and mask.device.type == "cpu" and bool(mask.all())


def _num_items_per_row(labels: torch.Tensor, num_items_in_batch, num_rows: int) -> torch.Tensor:
    if num_items_in_batch is None:
        num_items_in_batch = (labels[:, 1:] != IGNORE_INDEX).sum()
    count = torch.as_tensor(num_items_in_batch, device=labels.device)
    if count.numel() != 1:
        raise ValueError(f"`num_items_in_batch` must be a single count; got shape {tuple(count.shape)}.")
    return count.reshape(()).expand(num_rows).contiguous()
