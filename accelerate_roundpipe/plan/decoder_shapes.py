"""Decoder-only LM shapes (published config numbers) and their per-layer forward FLOPs per token.

The simulator uses these FLOPs as relative layer costs: only their ratios matter to partitions and bubble ratios. A
backward with recomputation costs 3x the forward (recompute + 2x backward), see
`partition.DEFAULT_BACKWARD_TO_FORWARD_COST`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DecoderShape:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = False


# Published architecture numbers (each model's config.json).
MODEL_SHAPES = {
    "qwen3-1.7b": DecoderShape(2048, 6144, 28, 16, 8, 128, 151936, True),
    "qwen3-4b": DecoderShape(2560, 9728, 36, 32, 8, 128, 151936, True),
    "qwen3-32b": DecoderShape(5120, 25600, 64, 64, 8, 128, 151936, False),
    "llama3.1-8b": DecoderShape(4096, 14336, 32, 32, 8, 128, 128256, False),
}


def decoder_layer_flops(shape: DecoderShape, seq_len: int = 4096) -> list[float]:
    """Forward FLOPs per token of each pipeline layer: embedding (a lookup, ~0), the decoder layers, and the final
    norm + LM head + loss. Attention scores count half (causal)."""
    h, q = shape.hidden_size, shape.num_attention_heads * shape.head_dim
    kv = shape.num_key_value_heads * shape.head_dim
    linear = 2 * (h * q + 2 * h * kv + q * h + 3 * h * shape.intermediate_size)
    attention = 2 * 2 * seq_len * q * 0.5
    head = 2 * h * shape.vocab_size
    return [float(h)] + [float(linear + attention)] * shape.num_hidden_layers + [float(head)]
