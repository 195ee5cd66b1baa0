"""The last pipeline layer: final norm + lm_head, then the micro-batch loss (or the logits when there are no labels).

The logits come from the causal LM's own forward run on a shell (see [Note: shells] in `shell.py`) whose inner model
is `FinalNorm`, so whatever the family does after its lm_head (Gemma's final logit soft-capping, logit scales) is
applied as HF applies it. The final norm itself (held by `FinalNorm`) is applied once to the whole micro-batch
before the loss chunks, as HF applies it to the whole batch: norms that reduce in float32 (Gemma) then sum their
weight gradient over the same tokens at once, and the norm is not recomputed per chunk.

The loss follows HF's `ForCausalLMLoss`: labels are given unshifted and shifted inside (the last position predicts
nothing), -100 is ignored, and the sum is divided by `num_items_in_batch`, the label count of the *whole* batch, so
the engine's sum over micro-batches is the batch loss. The cross-entropy runs over chunks of tokens, so the fp32
logits of only one chunk exist at a time, in forward and in backward. Logits are upcast to at least fp32 (fp64 models
keep fp64, where HF would drop to fp32).

[Note: fused loss path]
When the logits are exactly `F.linear(normed, lm_head.weight, lm_head.bias)` the head uses
`fused_linear_cross_entropy_sum` (`fused_ce.py`), which computes each chunk's logits once and their gradients right
away. That holds when the lm_head is a plain `nn.Linear` (type exactly: LoRA-wrapped or quantised heads are
subclasses or wrappers with their own forward), its weight has the hidden state's dtype, no autocast is active, and
the config names none of the operations families apply around the lm_head (`_LOGIT_TRANSFORM_CONFIG_NAMES`: Gemma's
soft-capping, Cohere's and Granite's logit scales, Falcon-H1's multiplier, ...). Otherwise each chunk runs the shell's
own forward under `torch.utils.checkpoint` (the lm_head matmul is then recomputed in backward), which applies
whatever the family does. `use_fused_loss = False` on the class or an instance forces the checkpointed path.

[Note: loss chunk size]
A chunk holds at most `loss_chunk_tokens` tokens and at most 1/`MIN_LOSS_CHUNKS` of the micro-batch's tokens. On the
checkpointed path its backward holds about three chunk-sized fp32 tensors at once (the saved log-probabilities, their
gradient and the logits' gradient), so the head's peak is about 3/`MIN_LOSS_CHUNKS` of one full fp32 logits tensor of
the micro-batch (plus the lm_head's weight gradient), whatever the micro-batch size; the fused path holds one chunk of
fp32 log-probabilities beside the chunk's input-dtype logits or gradient, plus an fp32 accumulator of the weight
gradient. `loss_chunk_tokens` caps it in absolute terms for large micro-batches (measured in
tests/models/test_head_memory.py).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .fused_ce import fused_linear_cross_entropy_sum
from .router_aux import with_router_aux_loss
from .token_fields import token_fields

IGNORE_INDEX = -100
# Fewest chunks a micro-batch's loss is split into (see [Note: loss chunk size]).
MIN_LOSS_CHUNKS = 8
# Config attributes of families that change the logits around the lm_head (in transformers' modeling files): any of
# them set means the fused path would miss it (see [Note: fused loss path]).
_LOGIT_TRANSFORM_CONFIG_NAMES = (
    "final_logit_softcapping",  # Gemma 2/3/3n/4, VaultGemma, Nanochat, Mistral-Large-4: tanh soft-capping
    "logits_soft_cap",  # RecurrentGemma
    "logit_scale",  # Cohere, Cohere2: logits * scale
    "logits_scaling",  # Granite family: logits / scale; MiniCPM3: hidden / scale before the lm_head
    "lm_head_multiplier",  # Falcon-H1
    "output_multiplier",  # Muse
    "output_multiplier_scale",
    "unpadded_vocab_size",  # Inkling: logits cut to the unpadded vocabulary
)


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
    """Stands in for the inner model inside the head shell. It holds the parts the inner model runs after its
    decoder layers, under their own names and in call order (the final norm; OPT's output projection), applies them
    in `apply_norm` (called by the head) and hands the already normed hidden state on to the lm_head unchanged."""

    def __init__(self, parts_after_layers: dict[str, nn.Module]):
        super().__init__()
        for name, module in parts_after_layers.items():
            self.add_module(name, module)
        self.part_names = list(parts_after_layers)

    def apply_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        for name in self.part_names:
            hidden = self._modules[name](hidden)
        return hidden

    def forward(self, *args, inputs_embeds=None, **kwargs):
        return _HiddenOnlyOutput(inputs_embeds)


class CausalLMHead(nn.Module):
    """Final norm + lm_head + chunked cross-entropy (see the module docstring and [Note: decoder batch layout]).

    `use_fused_loss` (class attribute, may be set per instance): False forces the checkpointed loss path even where
    the fused one applies (see [Note: fused loss path]).

    Args:
        causal_lm_shell: shell of the `*ForCausalLM` holding only `FinalNorm` (maybe inside wrapper shells) and the
            lm_head.
        lm_head_name: the lm_head's attribute name in `causal_lm_shell`.
        logits_kwargs: fixed keyword arguments for that shell's forward (e.g. `output_router_logits=False`).
        loss_chunk_tokens: most tokens (rows x positions) per cross-entropy chunk; a micro-batch is also cut into
            at least `MIN_LOSS_CHUNKS` chunks (see [Note: loss chunk size]).
        router_aux_loss_coef: weight of the router aux loss when the batch carries router statistics, else None.
    """

    use_fused_loss = True

    def __init__(
        self,
        causal_lm_shell: nn.Module,
        lm_head_name: str,
        logits_kwargs: dict,
        loss_chunk_tokens: int,
        router_aux_loss_coef: float | None,
    ):
        super().__init__()
        if loss_chunk_tokens < 1:
            raise ValueError(f"`loss_chunk_tokens` must be at least 1, got {loss_chunk_tokens}.")
        self.lm = causal_lm_shell
        self._final_norm_path = next(
            name for name, module in causal_lm_shell.named_modules() if isinstance(module, FinalNorm)
        )
        self._lm_head_name = lm_head_name
        config = getattr(causal_lm_shell, "config", None)
        self._logits_are_plain = config is not None and not _logit_transforms(config)
        self.logits_kwargs = dict(logits_kwargs)
        self.loss_chunk_tokens = loss_chunk_tokens
        self.router_aux_loss_coef = router_aux_loss_coef

    def vocabulary_split_problem(self) -> str | None:
        """Why this head cannot be cut into vocabulary shards ([Note: vocabulary shards] in `vocab_shards.py`), or
        None when it can: the logits must be exactly `F.linear(normed, W, b)`."""
        lm_head = self.lm._modules[self._lm_head_name] if self._lm_head_name is not None else None
        if type(lm_head) is not nn.Linear:
            return f"its lm_head is a {type(lm_head).__name__}, not a plain nn.Linear (LoRA or quantised heads)"
        if not self._logits_are_plain:
            return "its family transforms the logits after the lm_head (soft-capping, logit scales)"
        return None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`model(...).logits` for the last decoder layer's output `hidden`."""
        return self._logits_of_normed(self._normed(hidden))

    def _normed(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm.get_submodule(self._final_norm_path).apply_norm(hidden)

    def _logits_of_normed(self, normed: torch.Tensor) -> torch.Tensor:
        output = self.lm(inputs_embeds=normed, use_cache=False, **self.logits_kwargs)
        return output.logits if hasattr(output, "logits") else output[0]

    def forward(self, hidden, attention_mask, position_ids, *extras):
        if not extras:
            return self.logits(hidden)
        if len(extras) == 1:  # labels alone: the per-token fields of [Note: per-token fields]
            return self._token_fields(hidden, extras[0])
        if len(extras) == 3:  # router statistics without labels: logits and the statistics (eval loss with aux)
            router_counts, router_probs, _batch_tokens = extras
            return self.logits(hidden), router_counts, router_probs
        labels, num_items_in_batch = extras[-2], extras[-1]
        loss = self._cross_entropy_sum(hidden, labels) / num_items_in_batch[0]
        return with_router_aux_loss(loss, self.router_aux_loss_coef, extras, attention_mask, labels)

    def _cross_entropy_sum(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        normed = self._normed(hidden)
        shift_labels = nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        num_rows, seq_len = labels.shape
        chunk_tokens = min(self.loss_chunk_tokens, -(-num_rows * seq_len // MIN_LOSS_CHUNKS))
        lm_head = self._fusable_lm_head(normed)
        if lm_head is not None:
            return fused_linear_cross_entropy_sum(
                normed.reshape(-1, normed.shape[-1]),
                lm_head.weight,
                shift_labels.reshape(-1),
                bias=lm_head.bias,
                ignore_index=IGNORE_INDEX,
                chunk_tokens=max(1, chunk_tokens),
            )
        chunk_len = max(1, chunk_tokens // max(num_rows, 1))
        total = None
        for start in range(0, seq_len, chunk_len):
            args = (normed[:, start : start + chunk_len], shift_labels[:, start : start + chunk_len])
            if torch.is_grad_enabled():
                part = checkpoint(self._chunk_loss_sum, *args, use_reentrant=False)
            else:
                part = self._chunk_loss_sum(*args)
            total = part if total is None else total + part
        return total

    def _token_fields(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """[b, T, len(FIELDS)]: position t holds the fields of label t + 1 (the last position: zeros), computed over
        the same chunks as the loss, each checkpointed ([Note: loss chunk size])."""
        normed = self._normed(hidden)
        shift_labels = nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        num_rows, seq_len = labels.shape
        chunk_tokens = min(self.loss_chunk_tokens, -(-num_rows * seq_len // MIN_LOSS_CHUNKS))
        chunk_len = max(1, chunk_tokens // max(num_rows, 1))
        parts = []
        for start in range(0, seq_len, chunk_len):
            args = (normed[:, start : start + chunk_len], shift_labels[:, start : start + chunk_len])
            if torch.is_grad_enabled():
                parts.append(checkpoint(self._chunk_token_fields, *args, use_reentrant=False))
            else:
                parts.append(self._chunk_token_fields(*args))
        return torch.cat(parts, dim=1)

    def _chunk_token_fields(self, normed_chunk: torch.Tensor, labels_chunk: torch.Tensor) -> torch.Tensor:
        return token_fields(self._logits_of_normed(normed_chunk), labels_chunk)

    def _fusable_lm_head(self, normed: torch.Tensor) -> nn.Linear | None:
        """The lm_head when the fused loss computes exactly the logits HF would, else None ([Note: fused loss path])."""
        if not (self.use_fused_loss and self._logits_are_plain):
            return None
        lm_head = self.lm._modules[self._lm_head_name]
        if type(lm_head) is not nn.Linear or lm_head.weight.dtype != normed.dtype:
            return None
        if torch.is_autocast_enabled(normed.device.type):  # autocast would pick other matmul dtypes than HF's code
            return None
        return lm_head

    def _chunk_loss_sum(self, normed_chunk: torch.Tensor, labels_chunk: torch.Tensor) -> torch.Tensor:
        logits = self._logits_of_normed(normed_chunk)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            labels_chunk.reshape(-1).to(logits.device),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )


def _logit_transforms(config) -> list[str]:
    """The `_LOGIT_TRANSFORM_CONFIG_NAMES` set in `config` or its text config (multimodal configs nest it)."""
    configs = [config]
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else None
    if text_config is not None and text_config is not config:
        configs.append(text_config)
    return [name for c in configs for name in _LOGIT_TRANSFORM_CONFIG_NAMES if getattr(c, name, None) is not None]
