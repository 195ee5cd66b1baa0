"""Layer costs of a decoder-only LM from its shape alone: FLOP times and byte sizes, for planning before measuring.

A rough model, good for comparing plans and device counts, not for predicting step times. Per micro-batch of
`rows x seq_len` tokens on a device of `flops_per_s` (dense, achieved) with `param_bytes_per_element` weights:

- forward time = FLOPs (`decoder_shapes.decoder_layer_flops`) / flops_per_s; backward = 2x, recompute = 1x;
- parameters and gradients on the device in the weight dtype (gradients are converted to the optimizer's dtype
  while they are downloaded); LoRA (`lora_rank`) leaves the decoder weights frozen, with r x (in + out) adapter
  weights per projection, and the embedding and head frozen;
- a decoder layer keeps about (10 H + 4 I) activations per token for its backward (inputs of the two norms, q, k,
  v, the attention output, the o-projection's input, gate, up, their product; attention by a fused kernel, so no
  T x T scores), in the weight dtype; its backward's working set is about the same again;
- the head keeps its normed input and, per loss chunk of `loss_chunk_tokens` tokens, fp32 logits (its working set);
  the embedding keeps nothing.
"""

from __future__ import annotations

from .decoder_shapes import DecoderShape, decoder_layer_flops
from .layer_costs import LayerCosts


def shape_from_config(config) -> DecoderShape:
    """The `DecoderShape` of a Hugging Face decoder config (read by attribute name; a multimodal config's text
    config). Mixture-of-experts layers count as dense ones of `intermediate_size` (close enough to pick a head
    split; the planner re-plans from measured costs anyway). Raises ValueError naming a missing attribute."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    missing = [name for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
               if getattr(text, name, None) is None]
    if missing:
        raise ValueError(f"the model config has no {missing}: cannot cost its layers from its shape.")
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    intermediate = getattr(text, "intermediate_size", None) or 4 * text.hidden_size
    return DecoderShape(hidden_size=text.hidden_size, intermediate_size=intermediate,
                        num_hidden_layers=text.num_hidden_layers, num_attention_heads=heads,
                        num_key_value_heads=getattr(text, "num_key_value_heads", None) or heads, head_dim=head_dim,
                        vocab_size=text.vocab_size,
                        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)))


def layer_costs_from_shape(shape: DecoderShape, seq_len: int, rows: int = 1, flops_per_s: float = 150e12,
                           param_bytes_per_element: int = 2, lora_rank: int | None = None,
                           loss_chunk_tokens: int = 1024) -> LayerCosts:
    """`LayerCosts` of embedding, decoder layers and head for micro-batches of `rows` sequences (see the module
    docstring for what is counted)."""
    h, i, v = shape.hidden_size, shape.intermediate_size, shape.vocab_size
    q, kv = shape.num_attention_heads * shape.head_dim, shape.num_key_value_heads * shape.head_dim
    tokens = rows * seq_len
    e = param_bytes_per_element
    flops = decoder_layer_flops(shape, seq_len)
    forward = [f * tokens / flops_per_s for f in flops]

    decoder_params = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h
    table = v * h
    if lora_rank is None:
        trainable = [table] + [decoder_params] * shape.num_hidden_layers + [table + h]
    else:
        adapters = lora_rank * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h))
        trainable = [0] + [adapters] * shape.num_hidden_layers + [0]
        decoder_params += adapters
    params = [table] + [decoder_params] * shape.num_hidden_layers + [table + h]
    hidden_bytes = tokens * h * e
    decoder_acts = tokens * (10 * h + 4 * i) * e
    head_chunk = min(tokens, loss_chunk_tokens) * v * 4
    return LayerCosts(
        forward_s=forward,
        backward_s=[2 * f for f in forward],
        param_bytes=[p * e for p in params],
        grad_bytes=[t * e for t in trainable],
        act_bytes=[0] + [decoder_acts] * shape.num_hidden_layers + [hidden_bytes],
        input_bytes=[tokens * 8] + [hidden_bytes] * (shape.num_hidden_layers + 1),
        work_bytes=[0] + [decoder_acts] * shape.num_hidden_layers + [head_chunk],
    )
