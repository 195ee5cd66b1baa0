"""Model FLOPs per trained token of a decoder shape, for the MFU of our records and the anchors' alike; the formula
and its convention are `accelerate_roundpipe.telemetry.metrics.training_flops_per_token`'s.

A mixture of experts (`MoeShape`) counts what multiplies one token: the router and the `num_experts_per_tok`
experts it sends the token to, with their LoRA adapters (PEFT computes every expert's delta weight once a call,
which is hardware work, not model FLOPs); `active_only=False` counts what the model stores instead. Sliding-window
layers attend to the last `sliding_window` tokens, not the causal half of the sequence."""

from __future__ import annotations

from accelerate_roundpipe.plan.decoder_shapes import DecoderShape
from accelerate_roundpipe.telemetry.metrics import training_flops_per_token
from benchmarks.workloads import LORA_RANK, LORA_TARGETS, MoeShape

PEAK_TFLOPS = 989.0  # dense bf16 of one H100/H200 SXM: the MFU denominator of ours and the anchors'


def decoder_linears(shape: DecoderShape) -> dict[str, tuple[int, int]]:
    """(in, out) features of each linear layer of one decoder layer that every token runs (a mixture of experts:
    the attention and the router; its experts are `expert_matrices`)."""
    h, i = shape.hidden_size, shape.intermediate_size
    q, kv = shape.num_attention_heads * shape.head_dim, shape.num_key_value_heads * shape.head_dim
    attention = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
    if isinstance(shape, MoeShape):
        return {**attention, "router": (h, shape.num_experts)}
    return {**attention, "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def expert_matrices(shape: MoeShape) -> dict[str, tuple[int, int]]:
    """(in, out) of one expert's matrices: gate and up fused, then down."""
    h, i = shape.hidden_size, shape.moe_intermediate_size
    return {"gate_up_proj": (h, 2 * i), "down_proj": (i, h)}


def _experts(shape: DecoderShape, active_only: bool) -> int:
    """Experts a token multiplies by (or the model stores); 0 for a dense shape."""
    if not isinstance(shape, MoeShape):
        return 0
    return shape.num_experts_per_tok if active_only else shape.num_experts


def matmul_params(shape: DecoderShape, active_only: bool = True) -> int:
    """Weights multiplied by: the decoder layers' linears (a mixture of experts' active experts) and the LM head
    (tied or not; the input embedding is a gather)."""
    per_layer = sum(a * b for a, b in decoder_linears(shape).values())
    if isinstance(shape, MoeShape):
        per_layer += _experts(shape, active_only) * sum(a * b for a, b in expert_matrices(shape).values())
    return shape.num_hidden_layers * per_layer + shape.vocab_size * shape.hidden_size


def lora_params(shape: DecoderShape, rank: int = LORA_RANK, active_only: bool = True) -> int:
    """LoRA adapters on every target linear, A (rank x in) and B (out x rank); a mixture of experts' on its
    attention and on each (active) expert's matrices, at the ranks PEFT gives them (`MoeShape.expert_lora_ranks`)."""
    per_layer = sum(a + b for name, (a, b) in decoder_linears(shape).items() if name in LORA_TARGETS)
    if isinstance(shape, MoeShape):
        per_expert = sum(multiple * (a + b) for multiple, (a, b) in
                         zip(shape.expert_lora_ranks, expert_matrices(shape).values()))
        per_layer += _experts(shape, active_only) * per_expert
    return shape.num_hidden_layers * rank * per_layer


def attended_length(seq: int, window: int) -> float:
    """The length whose causal half one query of a sliding-window layer attends to on average: the mean over
    positions of min(position, window), doubled (continuous, as full causal attention counts seq / 2)."""
    return float(seq) if not window or window >= seq else 2 * window - window * window / seq


def workload_flops_per_token(shape: DecoderShape, seq: int, lora: bool) -> float:
    base = matmul_params(shape)
    trainable, frozen = (lora_params(shape), base) if lora else (base, 0)
    width = shape.num_attention_heads * shape.head_dim
    sliding = shape.sliding_layers if isinstance(shape, MoeShape) else 0
    flops = training_flops_per_token(trainable, frozen, shape.num_hidden_layers - sliding, width, seq)
    if sliding:
        flops += training_flops_per_token(0, 0, sliding, width, 1) * attended_length(seq, shape.sliding_window)
    return flops


def mfu(flops_per_token: float, tokens_per_s: float | None, peak_tflops: float = PEAK_TFLOPS) -> float | None:
    if tokens_per_s is None or not peak_tflops:
        return None
    return round(flops_per_token * tokens_per_s / (peak_tflops * 1e12), 3)
