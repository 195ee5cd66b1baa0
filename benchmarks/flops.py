"""Model FLOPs per trained token of a decoder shape, for the MFU of our records and the anchors' alike; the formula
and its convention are `accelerate_roundpipe.telemetry.metrics.training_flops_per_token`'s."""

from __future__ import annotations

from accelerate_roundpipe.plan.decoder_shapes import DecoderShape
from accelerate_roundpipe.telemetry.metrics import training_flops_per_token
from benchmarks.workloads import LORA_RANK, LORA_TARGETS

PEAK_TFLOPS = 989.0  # dense bf16 of one H100/H200 SXM: the MFU denominator of ours and the anchors'


def decoder_linears(shape: DecoderShape) -> dict[str, tuple[int, int]]:
    """(in, out) features of each linear layer of one decoder layer."""
    h, i = shape.hidden_size, shape.intermediate_size
    q, kv = shape.num_attention_heads * shape.head_dim, shape.num_key_value_heads * shape.head_dim
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
            "up_proj": (h, i), "down_proj": (i, h)}


def matmul_params(shape: DecoderShape) -> int:
    """Weights multiplied by: the decoder layers' linears and the LM head (tied or not; the input embedding is a
    gather)."""
    per_layer = sum(a * b for a, b in decoder_linears(shape).values())
    return shape.num_hidden_layers * per_layer + shape.vocab_size * shape.hidden_size


def lora_params(shape: DecoderShape, rank: int = LORA_RANK) -> int:
    """LoRA adapters on every target linear: A (rank x in) and B (out x rank)."""
    per_layer = sum(a + b for name, (a, b) in decoder_linears(shape).items() if name in LORA_TARGETS)
    return shape.num_hidden_layers * rank * per_layer


def workload_flops_per_token(shape: DecoderShape, seq: int, lora: bool) -> float:
    base = matmul_params(shape)
    trainable, frozen = (lora_params(shape), base) if lora else (base, 0)
    return training_flops_per_token(trainable, frozen, shape.num_hidden_layers,
                                    shape.num_attention_heads * shape.head_dim, seq)


def mfu(flops_per_token: float, tokens_per_s: float | None, peak_tflops: float = PEAK_TFLOPS) -> float | None:
    if tokens_per_s is None or not peak_tflops:
        return None
    return round(flops_per_token * tokens_per_s / (peak_tflops * 1e12), 3)
