"""One FLOP count for the live metrics and the benchmarks: `training_flops_per_token` read from a model equals the
benchmarks' count from its shape, for every benchmark architecture, full fine-tune and LoRA."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from accelerate_roundpipe.telemetry.metrics import model_training_flops_per_token, training_flops_per_token

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.flops import lora_params, matmul_params, workload_flops_per_token  # noqa: E402
from benchmarks.models import hf_config, lora_config  # noqa: E402
from benchmarks.workloads import HF_CONFIGS, SHAPES, MoeShape  # noqa: E402


def meta_model(arch: str, lora: bool) -> torch.nn.Module:
    """The benchmark model's layout without its memory (parameters on the meta device)."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config(arch, 4096))
    if lora:
        from peft import get_peft_model

        model = get_peft_model(model, lora_config(arch))
    return model


DENSE = sorted(arch for arch in HF_CONFIGS if not isinstance(SHAPES[arch], MoeShape))
MOE = sorted(arch for arch in HF_CONFIGS if isinstance(SHAPES[arch], MoeShape))


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("arch", DENSE)
def test_model_count_equals_shape_count(arch, lora):
    model = meta_model(arch, lora)
    for seq in (0, 4096):
        assert model_training_flops_per_token(model, seq) == workload_flops_per_token(SHAPES[arch], seq, lora)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("arch", MOE)
def test_a_mixture_of_experts_counts_its_active_experts(arch, lora):
    """[Note: active experts in the FLOP count]: the live metrics' count of a mixture of experts is the benchmarks'
    (router and top-k experts, with their adapters at PEFT's ranks), not every stored expert's. Attention is left
    out (seq 0, as the live metrics count it): the model count does not know sliding windows."""
    model = meta_model(arch, lora)
    shape = SHAPES[arch]
    assert model_training_flops_per_token(model, 0) == workload_flops_per_token(shape, 0, lora)
    if not shape.sliding_layers:
        assert model_training_flops_per_token(model, 4096) == workload_flops_per_token(shape, 4096, lora)
    stored = 6.0 * matmul_params(shape, active_only=False)  # what it counted before, for a full fine-tune
    if not lora:
        assert model_training_flops_per_token(model, 0) < stored / 2


def test_the_formula():
    # 6 per trainable weight, 4 per frozen one, causal attention 6 x layers x width x seq
    assert training_flops_per_token(10) == 60.0
    assert training_flops_per_token(10, 100) == 460.0
    assert training_flops_per_token(0, 0, layers=2, attention_width=8, seq_len=16) == 6.0 * 2 * 8 * 16
    shape = SHAPES["qwen3-1.7b"]  # tied embedding: the LM head counts once, the input embedding (a gather) not
    assert matmul_params(shape) == 28 * (2048 * 2048 * 2 + 2 * 2048 * 1024 + 3 * 2048 * 6144) + 151936 * 2048
    assert lora_params(shape) == 28 * 16 * (4096 + 2 * (2048 + 1024) + 4096 + 3 * (2048 + 6144))
