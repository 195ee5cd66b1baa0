"""The last pipeline layer: final norm + lm_head, then the micro-batch loss (or the logits when there are no labels).

The logits come from the causal LM's own forward run on a shell (see [Note: shells] in `shell.py`) whose inner model
is only the final norm, so whatever the family does after its lm_head (Gemma's final logit soft-capping, logit
scales) is applied as HF applies it.

The loss follows HF's `ForCausalLMLoss`: labels are given unshifted and shifted inside (the last position predicts
nothing), -100 is ignored, and the sum is divided by `num_items_in_batch`, the label count of the *whole* batch, so
the engine's sum over micro-batches is the batch loss. The cross-entropy runs over chunks of the sequence, each
under `torch.utils.checkpoint`, so the fp32 logits of only one chunk exist at a time, in forward and in backward.
Logits are upcast to at least fp32 (fp64 models keep fp64, where HF would drop to fp32).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .router_aux import router_aux_loss

IGNORE_INDEX = -100


class _HiddenOnlyOutput:
    """What the stub inner model returns: the normed hidden state, None for every other output field."""

    def __init__(self, last_hidden_state: torch.Tensor):
        self.last_hidden_state = last_hidden_state

    def __getattr__(self, name):
        return None

    def __getitem__(self, index):
        if index != 0:
            raise IndexError(index)
        return self.last_hidden_state


class FinalNorm(nn.Module):
    """Stands in for the inner model inside the head shell: applies the final norm to the given hidden state."""

    def __init__(self, norm: nn.Module | None):
        super().__init__()
        self.norm = norm

    def forward(self, *args, inputs_embeds=None, **kwargs):
        return _HiddenOnlyOutput(inputs_embeds if self.norm is None else self.norm(inputs_embeds))


class CausalLMHead(nn.Module):
    """Final norm + lm_head + chunked cross-entropy (see the module docstring and [Note: decoder batch layout]).

    Args:
        causal_lm_shell: shell of the `*ForCausalLM` holding only `FinalNorm` and the lm_head.
        logits_kwargs: fixed keyword arguments for that shell's forward (e.g. `output_router_logits=False`).
        loss_chunk_tokens: tokens (rows x positions) per cross-entropy chunk.
        router_aux_loss_coef: weight of the router aux loss when the batch carries router statistics, else None.
    """

    def __init__(
        self,
        causal_lm_shell: nn.Module,
        logits_kwargs: dict,
        loss_chunk_tokens: int,
        router_aux_loss_coef: float | None,
    ):
        super().__init__()
        if loss_chunk_tokens < 1:
            raise ValueError(f"`loss_chunk_tokens` must be at least 1, got {loss_chunk_tokens}.")
        self.lm = causal_lm_shell
        self.logits_kwargs = dict(logits_kwargs)
        self.loss_chunk_tokens = loss_chunk_tokens
        self.router_aux_loss_coef = router_aux_loss_coef

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        output = self.lm(inputs_embeds=hidden, use_cache=False, **self.logits_kwargs)
        return output.logits if hasattr(output, "logits") else output[0]

    def forward(self, hidden, attention_mask, position_ids, *extras):
        if not extras:
            return self.logits(hidden)
        labels, num_items_in_batch = extras[-2], extras[-1]
        loss = self._cross_entropy_sum(hidden, labels) / num_items_in_batch[0]
        if self.router_aux_loss_coef is not None:
            router_counts, router_probs, batch_tokens = extras[:3]
            micro_batch_tokens = attention_mask.sum() if attention_mask.shape[1] else labels.new_tensor(labels.numel())
            aux = router_aux_loss(router_counts, router_probs, batch_tokens, micro_batch_tokens)
            loss = loss + self.router_aux_loss_coef * aux.to(loss.dtype)
        return loss

    def _cross_entropy_sum(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        shift_labels = nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        num_rows, seq_len = labels.shape
        chunk_len = max(1, self.loss_chunk_tokens // max(num_rows, 1))
        total = None
        for start in range(0, seq_len, chunk_len):
            args = (hidden[:, start : start + chunk_len], shift_labels[:, start : start + chunk_len])
            if torch.is_grad_enabled():
                part = checkpoint(self._chunk_loss_sum, *args, use_reentrant=False)
            else:
                part = self._chunk_loss_sum(*args)
            total = part if total is None else total + part
        return total

    def _chunk_loss_sum(self, hidden_chunk: torch.Tensor, labels_chunk: torch.Tensor) -> torch.Tensor:
        logits = self.logits(hidden_chunk)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            labels_chunk.reshape(-1).to(logits.device),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
