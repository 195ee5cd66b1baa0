"""The LM head as several pipeline layers, one per vocabulary shard, carrying online-softmax statistics between them.

[Note: vocabulary shards]
With `head_shards=K` the head (final norm, lm_head, loss) becomes K pipeline layers ([Note: split head] in
`plan/head_split.py` for why). Shard k holds rows [start_k, stop_k) of the lm_head (its weight, and its bias if any);
shard 0 also applies the final norm, once, and passes the normed hidden state on. Per token n with next-token label
y_n, each shard computes its logits z = x W_k^T + b_k one chunk of tokens at a time and folds them into two numbers
that travel to the next shard as one [b, T, 2] tensor in the loss dtype (at least fp32):

    lse_out = logaddexp(lse_in, logsumexp(z))        (shard 0 starts from lse_in = -inf)
    t_out   = t_in + z[y_n - start_k] if start_k <= y_n < stop_k, else t_in

so after the last shard lse = logsumexp of the whole row of logits and t = the target's logit; the last shard returns
sum over labelled tokens of (lse - t) / num_items_in_batch, HF's loss. This is the online softmax with (max, sum of
exponentials) kept as one number, lse = max + log(sum), which needs no rescaling step.

The backward is exact and keeps no logits: given the gradients g_lse and g_t of a shard's outputs, its logits'
gradient is g_lse * exp(z - lse_out) + g_t * onehot(y_n - start_k) (recomputed chunk by chunk from the saved input,
one extra matmul per shard), and lse_in gets g_lse * exp(lse_in - lse_out). Chained from the last shard, whose
g_lse = 1/num_items = -g_t on labelled tokens, shard k's logits get exp(z - lse_final) / num_items - onehot / num_items:
softmax - one-hot, as for the whole head.

Without labels each shard appends its logits to a [b, T, stop_k] tensor it passes on, and the last returns
`model(...).logits`. The split applies only where the logits are exactly `F.linear(normed, W, b)` (a plain
`nn.Linear` lm_head, no logit transforms: [Note: fused loss path] in `head.py`); otherwise `shard_head` says so.
Per-token fields (TRL's fused LM head) are not computed by shards: use `head_shards=1` for them.

Every shard holds the whole lm_head module (one parameter for the user's optimizer, checkpoints and tied
embeddings), and says with `parameter_rows()` which rows it reads: a task running shard k uploads rows
[start_k, stop_k) of the weight (and bias) and downloads their gradient only ([Note: row windows] in
`runtime/state/host_store.py`), so K shards move one head's bytes between them, not K. Bound that way on a worker, the
shard's `lm_head.weight` *is* its rows; run whole (the split model outside the engine), it slices them itself.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.nn import functional

from ..config import RoundPipeConfig
from ..plan.head_split import head_shards_for
from ..plan.shape_costs import shape_from_config
from .head import IGNORE_INDEX, MIN_LOSS_CHUNKS, CausalLMHead
from .router_aux import with_router_aux_loss

logger = logging.getLogger(__name__)


def resolve_head_shards(config: RoundPipeConfig, model_config) -> int:
    """`config.head_shards` as a count: 1 when unset; for "auto", the count the planner picks from the model's
    FLOPs (`plan.head_split.head_shards_for`) for the configured devices and micro-batches per task."""
    value = config.resolved_head_shards
    if value != "auto" or model_config is None:  # no config: not an HF model, which `split_causal_lm` refuses
        count = 1 if value == "auto" else value
    else:
        count = _planned_head_shards(config, model_config)
    return count


def _planned_head_shards(config: RoundPipeConfig, model_config) -> int:
    num_devices = len(config.resolved_devices())
    num_microbatches = config.num_microbatches or 2 * num_devices  # the engine's default count
    per_task = min(config.microbatches_per_round or num_microbatches, num_microbatches)
    count = head_shards_for(shape_from_config(model_config), num_devices, per_task)
    logger.info("RoundPipe: head_shards='auto' cuts the head into %d vocabulary shards for %d devices.", count,
                num_devices)
    return count


def shard_bounds(vocab_size: int, num_shards: int) -> list[tuple[int, int]]:
    """[start, stop) rows of each shard: as even as possible, the first shards one row longer."""
    if not 1 <= num_shards <= vocab_size:
        raise ValueError(f"head_shards must be between 1 and the vocabulary size ({vocab_size}), got {num_shards}.")
    base, extra = divmod(vocab_size, num_shards)
    bounds, start = [], 0
    for k in range(num_shards):
        stop = start + base + (k < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


def shard_head(head: CausalLMHead, num_shards: int) -> list[VocabShard]:
    """The K pipeline layers that replace `head` ([Note: vocabulary shards]). Raises ValueError naming what prevents
    the split and the knob to turn (`head_shards=1`)."""
    problem = head.vocabulary_split_problem()
    if problem is not None:
        raise ValueError(f"head_shards={num_shards}: the head of {type(head.lm).__name__} cannot be split into "
                         f"vocabulary shards: {problem}. Set head_shards=1 (env ROUNDPIPE_HEAD_SHARDS).")
    lm_head = head.lm._modules[head._lm_head_name]
    # The final norm and every other part after the layers ([Note: parts around the decoder layers]).
    final_norm = head.lm.get_submodule(head._final_norm_path)
    bounds = shard_bounds(lm_head.out_features, num_shards)
    return [VocabShard(lm_head, final_norm if k == 0 else None, start, stop, k == num_shards - 1,
                       head.loss_chunk_tokens, head.router_aux_loss_coef)
            for k, (start, stop) in enumerate(bounds)]


class VocabShard(nn.Module):
    """One vocabulary shard of the head ([Note: vocabulary shards]).

    Takes `(hidden, attention_mask, position_ids, *extras)` (shard 0: the last decoder layer's output; the others:
    the normed hidden state, with the carried statistics or logits appended) and returns the same with its own
    appended, or, the last shard, the loss (labels) or the logits (no labels).
    """

    def __init__(self, lm_head: nn.Linear, final_norm: nn.Module | None, start: int, stop: int, is_last: bool,
                 loss_chunk_tokens: int, router_aux_loss_coef: float | None):
        super().__init__()
        self.lm_head = lm_head
        self.final_norm = final_norm
        self.start, self.stop = start, stop
        self.is_last = is_last
        self.loss_chunk_tokens = loss_chunk_tokens
        self.router_aux_loss_coef = router_aux_loss_coef

    @property
    def is_first(self) -> bool:
        return self.final_norm is not None

    def extra_repr(self) -> str:
        return f"rows {self.start}..{self.stop - 1}, first={self.is_first}, last={self.is_last}"

    def parameter_rows(self) -> dict[str, tuple[int, int]]:
        """The rows of the lm_head this shard reads ([Note: row windows])."""
        rows = {"lm_head.weight": (self.start, self.stop)}
        if self.lm_head.bias is not None:
            rows["lm_head.bias"] = (self.start, self.stop)
        return rows

    def _rows(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """This shard's rows of the lm_head `tensor`: bound to them on a worker, else sliced from the whole. (A
        shard has fewer rows than the vocabulary, so the two cases never look alike.)"""
        if tensor is None or tensor.shape[0] == self.stop - self.start:
            return tensor
        return tensor[self.start:self.stop]

    def forward(self, hidden, attention_mask, position_ids, *rest):
        if self.is_first:
            extras, carried = rest, None
            hidden = self.final_norm.apply_norm(hidden)
        else:
            extras, carried = rest[:-1], rest[-1]
            hidden = hidden.view_as(hidden)  # passed on: its gradient is the sum of every later shard's
        weight, bias = self._rows(self.lm_head.weight), self._rows(self.lm_head.bias)
        if len(extras) == 1:
            raise NotImplementedError("per-token fields (TRL's fused LM head) are not computed by a head split into "
                                      "vocabulary shards; set head_shards=1 (env ROUNDPIPE_HEAD_SHARDS).")
        if len(extras) in (0, 3):  # no labels: logits (and, with 3 extras, the router statistics)
            logits = functional.linear(hidden, weight, bias)
            logits = logits if carried is None else torch.cat([carried, logits], dim=-1)
            if not self.is_last:
                return (hidden, attention_mask, position_ids, *extras, logits)
            return logits if not extras else (logits, extras[0], extras[1])
        labels, num_items_in_batch = extras[-2], extras[-1]
        shift_labels = functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        num_rows, seq_len = labels.shape
        accumulate = torch.promote_types(hidden.dtype, torch.float32)
        if carried is None:
            carried = torch.stack([torch.full(labels.shape, -torch.inf, dtype=accumulate, device=hidden.device),
                                   torch.zeros(labels.shape, dtype=accumulate, device=hidden.device)], dim=-1)
        chunk_tokens = min(self.loss_chunk_tokens, -(-num_rows * seq_len // MIN_LOSS_CHUNKS))
        stats = _ShardStatistics.apply(hidden.reshape(-1, hidden.shape[-1]), weight, bias,
                                       carried.reshape(-1, 2), shift_labels.reshape(-1).to(hidden.device),
                                       self.start, max(1, chunk_tokens))
        stats = stats.reshape(num_rows, seq_len, 2)
        if not self.is_last:
            return (hidden, attention_mask, position_ids, *extras, stats)
        valid = shift_labels.to(stats.device) != IGNORE_INDEX
        loss = torch.where(valid, stats[..., 0] - stats[..., 1], 0).sum() / num_items_in_batch[0]
        return with_router_aux_loss(loss, self.router_aux_loss_coef, extras, attention_mask, labels)


class _ShardStatistics(torch.autograd.Function):
    """(x [N, H], W_k, b_k, carried [N, 2] = (lse, target logit), labels [N]) -> the updated [N, 2], the logits
    computed one chunk of tokens at a time and recomputed in backward ([Note: vocabulary shards])."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, carried, labels, start: int, chunk_tokens: int):
        accumulate = carried.dtype
        in_shard = (labels >= start) & (labels < start + weight.shape[0])
        local = torch.where(in_shard, labels - start, 0)[:, None]
        shard_lse = torch.empty(hidden.shape[0], dtype=accumulate, device=hidden.device)
        target = torch.zeros(hidden.shape[0], dtype=accumulate, device=hidden.device)
        for begin in range(0, hidden.shape[0], chunk_tokens):
            end = begin + chunk_tokens
            logits = functional.linear(hidden[begin:end], weight, bias).to(accumulate)
            shard_lse[begin:end] = torch.logsumexp(logits, dim=1)
            target[begin:end] = logits.gather(1, local[begin:end]).squeeze(1)
            del logits
        lse_in = carried[:, 0]
        lse_out = torch.logaddexp(lse_in, shard_lse)
        target_out = carried[:, 1] + torch.where(in_shard, target, 0)
        ctx.save_for_backward(hidden, weight, bias, lse_in, lse_out, local, in_shard)
        ctx.chunk_tokens = chunk_tokens
        return torch.stack([lse_out, target_out], dim=1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_stats):
        hidden, weight, bias, lse_in, lse_out, local, in_shard = ctx.saved_tensors
        want_hidden, want_weight, want_bias, want_carried = ctx.needs_input_grad[:4]
        accumulate = lse_out.dtype
        grad_lse, grad_target = grad_stats[:, 0].to(accumulate), grad_stats[:, 1].to(accumulate)
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=accumulate, device=weight.device) if want_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=accumulate, device=bias.device) if want_bias else None
        target_grad = torch.where(in_shard, grad_target, 0)[:, None]
        for begin in range(0, hidden.shape[0], ctx.chunk_tokens):
            end = begin + ctx.chunk_tokens
            chunk = hidden[begin:end]
            logits = functional.linear(chunk, weight, bias).to(accumulate)
            # d lse_out / d z = exp(z - lse_out); d t_out / d z = onehot of the local target.
            grad_logits = logits.sub_(lse_out[begin:end, None]).exp_().mul_(grad_lse[begin:end, None])
            grad_logits.scatter_add_(1, local[begin:end], target_grad[begin:end])
            grad_logits = grad_logits.to(hidden.dtype)
            if grad_hidden is not None:
                torch.mm(grad_logits, weight, out=grad_hidden[begin:end])
            if grad_weight is not None:
                grad_weight += (grad_logits.t() @ chunk).to(accumulate)
            if grad_bias is not None:
                grad_bias += grad_logits.sum(dim=0, dtype=accumulate)
            del logits, grad_logits
        grad_carried = None
        if want_carried:
            grad_carried = torch.stack([grad_lse * torch.exp(lse_in - lse_out), grad_target], dim=1)
        return (grad_hidden,
                None if grad_weight is None else grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(bias.dtype),
                grad_carried, None, None, None)
