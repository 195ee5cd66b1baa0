"""Fused lm_head matmul + cross-entropy sum whose gradients are computed in forward, one token chunk at a time.

[Note: fused linear cross-entropy]
The loss is a scalar, so the gradient of everything after it is known up to one factor (the incoming scalar
`grad_output`) while the logits are still at hand. For each chunk of tokens the forward computes the logits once
(`hidden @ W^T + b` in the input dtype, as `nn.Linear` does), their log-softmax in at least fp32 (the chunk's
cross-entropy sum is read off it), and from it the logits' gradient, softmax - one-hot, cast to the input dtype as
`nn.Linear`'s backward would receive it. That gradient goes through the matmul at once: `grad_hidden[chunk] =
grad_logits @ W` and `grad_W += grad_logits^T @ hidden[chunk]` (`grad_W` and `grad_b` accumulated in fp32 across
chunks). Only these gradients are saved; backward multiplies them by `grad_output`. Compared with a checkpointed chunk,
the lm_head matmul is not recomputed in backward, there are fewer passes over the [chunk, V] tensors, and one chunk's
fp32 log-probabilities (plus the input-dtype logits or gradient beside them) is the largest temporary. The price is
that the gradients are computed even if backward never runs, so without grad mode only the loss is computed.
"""

from __future__ import annotations

import torch
from torch.nn import functional

# Tokens per chunk when the caller gives none: 1024 x a 152k vocabulary is about 0.6 GB of fp32 logits.
DEFAULT_CHUNK_TOKENS = 1024


def fused_linear_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> torch.Tensor:
    """`F.cross_entropy(F.linear(hidden, weight, bias).float(), labels, reduction="sum")` (logits upcast to at
    least fp32) without ever holding more than `chunk_tokens` rows of logits (see [Note: fused linear cross-entropy]).

    Args:
        hidden: [N, H] token states. weight: [V, H]. labels: [N] class ids, `ignore_index` for tokens without loss.
        bias: [V] or None.
    Returns the 0-dim loss sum in fp32 (fp64 for fp64 inputs); 0 when every label is ignored.
    """
    if hidden.dim() != 2 or labels.shape != hidden.shape[:1]:
        raise ValueError(f"expected hidden [N, H] and labels [N], got {tuple(hidden.shape)} and {tuple(labels.shape)}")
    if chunk_tokens < 1:
        raise ValueError(f"`chunk_tokens` must be at least 1, got {chunk_tokens}.")
    labels = labels.to(hidden.device)
    tensors = (hidden, weight) if bias is None else (hidden, weight, bias)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _FusedLinearCrossEntropySum.apply(hidden, weight, bias, labels, ignore_index, chunk_tokens)
    total = _zero_loss(hidden)
    for start in range(0, hidden.shape[0], chunk_tokens):
        end = start + chunk_tokens
        loss, _ = _chunk_loss(hidden[start:end], weight, bias, labels[start:end], ignore_index, want_grad=False)
        total += loss
    return total


class _FusedLinearCrossEntropySum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, ignore_index: int, chunk_tokens: int):
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        accumulate = _accumulation_dtype(hidden)
        grad_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=accumulate, device=weight.device) if want_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=accumulate, device=bias.device) if want_bias else None
        total = _zero_loss(hidden)
        for start in range(0, hidden.shape[0], chunk_tokens):
            end = start + chunk_tokens
            chunk, ignored = hidden[start:end], (labels[start:end] == ignore_index)[:, None]
            loss, grad_logits = _chunk_loss(chunk, weight, bias, labels[start:end], ignore_index, want_grad=True)
            total += loss
            # The rows of ignored tokens in grad_logits are not zeroed (a pass over [n, V]); they are kept out of the
            # gradients on the [n, H] side instead, which is exact: their hidden rows are zeroed for grad_W.
            if grad_hidden is not None:
                torch.mm(grad_logits, weight, out=grad_hidden[start:end])
                grad_hidden[start:end].masked_fill_(ignored, 0)
            if grad_weight is not None:
                _add_matmul(grad_weight, grad_logits.t(), chunk.masked_fill(ignored, 0))
            if grad_bias is not None:
                grad_bias += grad_logits.masked_fill(ignored, 0).sum(dim=0, dtype=accumulate)
            del grad_logits  # else it lives on while the next chunk's logits are allocated: two chunks at once
        ctx.grads = (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
        )
        return total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        saved = getattr(ctx, "grads", None)
        if saved is None:
            raise RuntimeError("fused_linear_cross_entropy_sum supports one backward per forward (no retain_graph).")
        del ctx.grads  # freed now, not when the caller drops the loss: grad_W is as large as the lm_head
        # In place: the saved gradients are this node's alone, and a copy would add a second lm_head-sized grad_W
        # at the head's memory peak.
        grads = tuple(None if g is None else g.mul_(grad_output.to(g.dtype)) for g in saved)
        return (*grads, None, None, None)


def _chunk_loss(
    chunk: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    ignore_index: int,
    want_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The chunk's loss sum and, if `want_grad`, the gradient of the loss w.r.t. the logits, in the input dtype as
    nn.Linear's backward would get it (softmax - one-hot computed in fp32/fp64, then cast). The gradient rows of ignored
    tokens are left unzeroed: the caller keeps them out of the parameter and hidden gradients."""
    logits = functional.linear(chunk, weight, bias)
    # log_softmax upcasts as it reads (on CUDA in the same kernel): the logits are never copied to fp32 first.
    log_probs = torch.log_softmax(logits, dim=1, dtype=_accumulation_dtype(chunk))
    del logits
    valid = labels != ignore_index
    safe_labels = labels.masked_fill(~valid, 0)[:, None]  # any in-range id: ignored rows are masked out
    target_log_probs = log_probs.gather(1, safe_labels).squeeze(1)
    loss = -torch.where(valid, target_log_probs, 0).sum()
    if not want_grad:
        return loss, None
    if log_probs.dtype == chunk.dtype:
        grad_logits = log_probs.exp_()
    else:  # the softmax is written straight in the input dtype: no second fp32 chunk
        grad_logits = torch.exp(log_probs, out=torch.empty_like(log_probs, dtype=chunk.dtype))
    del log_probs
    # The target column, from the fp32 probability, so that p - 1 is rounded once (as the cast of an fp32 gradient).
    grad_logits.scatter_(1, safe_labels, (target_log_probs.exp() - 1).to(chunk.dtype)[:, None])
    return loss, grad_logits


_mixed_addmm = True  # whether this torch has addmm(..., out_dtype=) on CUDA; found out at the first call


def _add_matmul(accumulator: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> None:
    """`accumulator += left @ right`, with a low-precision product accumulated in the accumulator's fp32."""
    if left.dtype == accumulator.dtype:
        accumulator.addmm_(left, right)  # no [V, H] temporary
        return
    global _mixed_addmm
    if accumulator.is_cuda and _mixed_addmm:
        try:  # cuBLAS adds the bf16 product to the fp32 accumulator in place: no [V, H] temporary either
            torch.addmm(accumulator, left, right, out_dtype=accumulator.dtype, out=accumulator)
            return
        except (TypeError, NotImplementedError):  # torch before 2.8 has no out_dtype: settled once, not per chunk
            _mixed_addmm = False
    # CPU has no mixed-dtype addmm: the product is rounded once per chunk, then summed in fp32.
    accumulator += left @ right


def _accumulation_dtype(tensor: torch.Tensor) -> torch.dtype:
    # Low-precision logits go to fp32; fp64 stays fp64.
    return torch.promote_types(tensor.dtype, torch.float32)


def _zero_loss(hidden: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=_accumulation_dtype(hidden), device=hidden.device)
