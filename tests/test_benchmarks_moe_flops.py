"""Model FLOPs of the mixture-of-experts benchmark models (`benchmarks.flops`): per token only the router and the
`num_experts_per_tok` experts a token is sent to multiply (top-8 of 128 in Qwen3-30B-A3B, top-4 of 32 in
GPT-OSS-20B), with their LoRA adapters; GPT-OSS's sliding-window layers attend to 128 tokens, not the causal half of
the sequence. Checked against hand computations from the published configs, and the stored counts (every expert)
against the models PEFT builds."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.flops import lora_params, matmul_params, workload_flops_per_token  # noqa: E402
from benchmarks.models import hf_config, lora_config  # noqa: E402
from benchmarks.workloads import HF_CONFIGS, SHAPES, MoeShape  # noqa: E402

MOE_ARCHS = sorted(arch for arch, shape in SHAPES.items() if isinstance(shape, MoeShape))
ROOT = Path(__file__).resolve().parents[1]


def test_the_moe_archs():
    assert {"qwen3-30b-a3b", "gpt-oss-20b", "tiny-qwen3-moe", "tiny-gpt-oss"} <= set(MOE_ARCHS)


def test_qwen3_30b_a3b_lora_by_hand():
    h, q, kv, experts, top_k, width, layers, vocab, r = 2048, 32 * 128, 4 * 128, 128, 8, 768, 48, 151936, 16
    attention = h * q + 2 * h * kv + q * h
    expert = h * 2 * width + width * h  # gate_up (gate and up fused) + down
    frozen = layers * (attention + h * experts + top_k * expert) + vocab * h  # router; untied LM head
    assert frozen == 3_041_656_832
    # PEFT fuses the gate_proj and up_proj adapters into one of rank 2r on gate_up_proj (its v4 -> v5 conversion)
    adapters = layers * (r * ((h + q) + 2 * (h + kv) + (q + h))
                         + top_k * (2 * r * (h + 2 * width) + r * (width + h)))
    assert adapters == 74_711_040
    attention_flops = 6 * layers * q * 4096
    expected = 6 * adapters + 4 * frozen + attention_flops
    assert expected == 17_446_731_776
    shape = SHAPES["qwen3-30b-a3b"]
    assert matmul_params(shape) == frozen and lora_params(shape) == adapters
    assert workload_flops_per_token(shape, 4096, True) == expected
    # full fine-tuning: every active weight trainable
    assert workload_flops_per_token(shape, 4096, False) == 6 * frozen + attention_flops
    # 3.0B of the 30.5B matrix weights multiply a token
    assert matmul_params(shape, active_only=False) == layers * (attention + h * experts + experts * expert) + vocab * h


def test_gpt_oss_20b_lora_by_hand():
    h, q, kv, experts, top_k, width, layers, vocab, r, window = 2880, 64 * 64, 8 * 64, 32, 4, 2880, 24, 201088, 16, 128
    attention = h * q + 2 * h * kv + q * h
    expert = h * 2 * width + width * h
    frozen = layers * (attention + h * experts + top_k * expert) + vocab * h
    assert frozen == 3_607_142_400
    adapters = layers * (r * ((h + q) + 2 * (h + kv) + (q + h)) + top_k * (r * (h + 2 * width) + r * (width + h)))
    assert adapters == 30_081_024
    seq = 4096
    # 12 full layers over the causal half of 4096 tokens; 12 sliding ones over the last 128 (2 x 128 - 128^2 / 4096
    # = 252: the mean over positions of min(position, 128), doubled, as full attention's is seq / 2)
    attention_flops = 6 * q * (12 * seq + 12 * (2 * window - window * window / seq))
    assert attention_flops == 6 * 4096 * 12 * (4096 + 252)
    expected = 6 * adapters + 4 * frozen + attention_flops
    assert expected == 15_891_333_120
    shape = SHAPES["gpt-oss-20b"]
    assert matmul_params(shape) == frozen and lora_params(shape) == adapters
    assert workload_flops_per_token(shape, seq, True) == expected


def meta_model(arch: str):
    """The benchmark model with its LoRA, on the meta device (its layout without memory)."""
    import transformers
    from peft import get_peft_model

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config(arch, 4096))
        return get_peft_model(model, lora_config(arch))


def stored(model) -> tuple[int, int]:
    """(frozen, trainable) elements of the matrices the model holds, the input embedding and the experts' biases
    (GPT-OSS's `gate_up_proj_bias`, experts x features: 2-D, but added, not multiplied) left out."""
    held = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            continue
        for name, p in module.named_parameters(recurse=False):
            if p.dim() >= 2 and not name.endswith("bias"):
                held[id(p)] = p
    trainable = sum(p.numel() for p in held.values() if p.requires_grad)
    return sum(p.numel() for p in held.values()) - trainable, trainable


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_stored_counts_are_the_models(arch):
    # every expert stored, adapters included: the shape's layout (ranks of the fused adapters too) is PEFT's
    frozen, trainable = stored(meta_model(arch))
    shape = SHAPES[arch]
    assert frozen == matmul_params(shape, active_only=False)
    assert trainable == lora_params(shape, active_only=False)
    config = hf_config(arch, 4096)
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    assert (experts, config.num_experts_per_tok, config.num_hidden_layers) == (
        shape.num_experts, shape.num_experts_per_tok, shape.num_hidden_layers)


def _literal(node: ast.AST):
    """A literal, or a literal list times a literal count (`layer_types=[...] * 12`)."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        return ast.literal_eval(node.left) * ast.literal_eval(node.right)
    return ast.literal_eval(node)


def _anchor_configs() -> dict | None:
    """The anchors' QWEN3_30B_A3B and GPT_OSS_20B (common.py, read, not imported), when a copy is at hand."""
    for path in (ROOT / ".anchors" / "common.py", ROOT.parent / "shared" / "anchors" / "common.py"):
        if path.is_file():
            tree = ast.parse(path.read_text())
            out = {}
            for node in tree.body:
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and \
                        getattr(node.value.func, "id", None) == "dict":
                    out[node.targets[0].id] = {k.arg: _literal(k.value) for k in node.value.keywords}
            return out
    return None


@pytest.mark.skipif(_anchor_configs() is None, reason="no copy of the anchors' common.py")
def test_configs_are_the_anchors():
    anchors = _anchor_configs()
    assert HF_CONFIGS["qwen3-30b-a3b"] == ("Qwen3MoeConfig", anchors["QWEN3_30B_A3B"])
    assert HF_CONFIGS["gpt-oss-20b"] == ("GptOssConfig", anchors["GPT_OSS_20B"])


def test_anchor_records_use_the_moe_count():
    # the reference's records of the same model get the same count (benchmarks/anchor_records.py recounts their MFU)
    from benchmarks.anchor_records import anchor_mfu
    from benchmarks.flops import mfu

    record = {"model": "qwen3-30b-a3b", "seq": 4096, "method": "roundpipe LoRA"}
    assert anchor_mfu(record, 10_000.0) == mfu(17_446_731_776, 10_000.0) == round(17_446_731_776e4 / 989e12, 3)
