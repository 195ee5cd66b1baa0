"""The largest activation transient of one decoder layer, per row, from a Hugging Face config alone: what the engine
knows of a layer's memory before its first pass has measured it ([Note: first-pass micro-batches] in
`first_pass_sizing.py`).

[Note: one layer's transient per row]
Three parts, each in the compute dtype's element size, for one row of `seq_len` tokens; every count is an upper
estimate, since the point is to stay out of an out-of-memory error, and the measured plan re-sizes from what the
first pass really used:

- scores: only where the attention implementation materialises them (`eager`; sdpa, flash and flex attention run
  fused kernels that never hold a q x k tensor): heads x seq_len x seq_len, times `SCORE_COPIES`. The eager code
  (GPT-OSS's `eager_attention_forward`, the others are a subset of it) holds at its peak, with autograd on: the
  scaled scores, the masked ones (both alive until the softmax's result replaces the name), the sinks' concatenation
  ([.., k+1]), the max-shifted logits, the softmax's probabilities (saved for its backward) and the contiguous copy of
  the sink-dropped probabilities the value matmul reads (or dropout's output). Not all at once: the scaled scores are
  freed after the mask is added, the concatenation after the shift. Four is the most alive at one time; Llama's
  eager path, whose float32 softmax is two bf16 copies wide, stays within it too. Observed: GPT-OSS-20B at 4 rows of
  4096 tokens asked for its second 8 GiB copy (one copy is 2 GiB a row) with 17.56 GiB allocated on a 24 GiB card.
- mlp: a dense MLP's gate, up, activation and product: `MLP_COPIES` x intermediate per token; a mixture of experts'
  the same per token and chosen expert (top_k x expert width), plus the dispatched input and output of every
  (token, expert) pair (2 x hidden each), which the experts' loop gathers and scatters.
- hidden: the hidden states the layer holds around its two blocks (the residual, the normed input, the attention
  output, the MLP's output: `HIDDEN_COPIES` x hidden) and the q, k, v projections.
"""

from __future__ import annotations

from dataclasses import dataclass

from .shape_costs import shape_from_config

SCORE_COPIES = 4  # [Note: one layer's transient per row]
MLP_COPIES = 4  # gate, up, act(gate), act(gate) * up
HIDDEN_COPIES = 4  # residual, normed input, attention output, MLP output
SCORE_MATERIALISING = frozenset({"eager"})  # attention implementations that hold q x k scores


@dataclass(frozen=True)
class RowActivations:
    """One decoder layer's transient bytes for one row, by part ([Note: one layer's transient per row])."""

    scores_bytes: int  # 0 where attention runs a fused kernel
    mlp_bytes: int
    hidden_bytes: int
    attention: str  # the attention implementation read from the config ("sdpa", "eager", ...; "" if unset)
    experts: bool  # the MLP part is a mixture of experts'

    @property
    def total_bytes(self) -> int:
        return self.scores_bytes + self.mlp_bytes + self.hidden_bytes

    def largest_part(self) -> tuple[str, int]:
        """The name (as the start summary says it) and bytes of the largest part."""
        mlp = "the experts' intermediates" if self.experts else "the MLP's intermediates"
        parts = [(f"{self.attention} attention's scores", self.scores_bytes), (mlp, self.mlp_bytes),
                 ("the hidden states", self.hidden_bytes)]
        return max(parts, key=lambda part: part[1])


def _experts(text) -> tuple[int, int] | None:
    """(top_k, expert width) of a mixture-of-experts config, else None. Qwen-style configs name the width
    `moe_intermediate_size`; GPT-OSS and Mixtral name their experts `num_local_experts` and the width
    `intermediate_size`."""
    top_k = getattr(text, "num_experts_per_tok", None)
    stored = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
    if not top_k or not stored:
        return None
    width = getattr(text, "moe_intermediate_size", None) or getattr(text, "intermediate_size", None)
    return (int(top_k), int(width)) if width else None


def row_activations(model_config, seq_len: int, element_size: int) -> RowActivations | None:
    """The estimate for one row of `seq_len` tokens of a layer of `model_config` (a multimodal config's text config);
    None when the config lacks a decoder's shape (not a Hugging Face decoder: nothing to estimate)."""
    try:
        shape = shape_from_config(model_config)
    except ValueError:
        return None
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    attention = getattr(text, "_attn_implementation", None) or ""
    h, tokens = shape.hidden_size, seq_len
    scores = shape.num_attention_heads * tokens * tokens * SCORE_COPIES if attention in SCORE_MATERIALISING else 0
    experts = _experts(text)
    if experts is None:
        mlp = tokens * shape.intermediate_size * MLP_COPIES
    else:
        top_k, width = experts
        mlp = tokens * top_k * (MLP_COPIES * width + 2 * h)
    projections = (shape.num_attention_heads + 2 * shape.num_key_value_heads) * shape.head_dim
    hidden = tokens * (HIDDEN_COPIES * h + projections)
    return RowActivations(scores * element_size, mlp * element_size, hidden * element_size, attention,
                          experts is not None)
