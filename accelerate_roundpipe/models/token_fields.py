"""Per-token log-probabilities of the labels (and what preference and SFT losses log beside them), from the logits.

[Note: per-token fields]
Losses other than the model's own (DPO's sigmoid of summed log-ratios, SFT variants, TRL's metrics) need each label
token's log-probability, not one scalar loss. TRL asks for them by calling the model with `fused_lm_head=True`
(`trl.trainer.utils.add_fused_lm_head`); the RoundPipe model answers that call itself: the head computes, per
position, the fields below from the logits of one chunk of tokens at a time (checkpointed, so the logits of the
whole micro-batch never exist at once, in forward or in backward), and returns them as one [b, T, FIELDS] tensor
that travels back to the host attached to the backward pipeline. The caller's loss is then an ordinary function of
those tensors; its backward runs the backward pipeline. Only `log_probs` and `entropy` carry gradients (as in TRL);
every field is zero where the (shifted) label is -100.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100
# Column order of the head's output (see [Note: per-token fields]).
FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def token_fields(logits: torch.Tensor, shifted_labels: torch.Tensor) -> torch.Tensor:
    """[..., V] logits and [...] next-token labels (-100 ignored) -> [..., len(FIELDS)] in the logits' precision
    (at least float32)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    mask = shifted_labels != IGNORE_INDEX
    targets = shifted_labels.clamp(min=0).to(logits.device).unsqueeze(-1)
    log_z = torch.logsumexp(logits, dim=-1, keepdim=True)
    log_p = logits - log_z
    log_probs = log_p.gather(-1, targets).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    with torch.no_grad():
        log_sum_sq_probs = torch.logsumexp(2 * log_p, dim=-1)
        mean_logits = logits.mean(-1)
        is_top1 = (logits.argmax(-1, keepdim=True) == targets).squeeze(-1).to(logits.dtype)  # first argmax, as TRL
    fields = torch.stack([log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1], dim=-1)
    return fields * mask.unsqueeze(-1).to(fields.dtype)
