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


# The live metrics count every matrix a model stores; a mixture of experts multiplies a token by its active experts
# only, which the benchmarks count (tests/test_benchmarks_moe_flops.py).
DENSE = sorted(arch for arch in HF_CONFIGS if not isinstance(SHAPES[arch], MoeShape))


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("arch", DENSE)
def test_model_count_equals_shape_count(arch, lora):
    model = meta_model(arch, lora)
    for seq in (0, 4096):
        assert model_training_flops_per_token(model, seq) == workload_flops_per_token(SHAPES[arch], seq, lora)


def test_the_formula():
    # 6 per trainable weight, 4 per frozen one, causal attention 6 x layers x width x seq
    assert training_flops_per_token(10) == 60.0
    assert training_flops_per_token(10, 100) == 460.0
    assert training_flops_per_token(0, 0, layers=2, attention_width=8, seq_len=16) == 6.0 * 2 * 8 * 16
    shape = SHAPES["qwen3-1.7b"]  # tied embedding: the LM head counts once, the input embedding (a gather) not
    assert matmul_params(shape) == 28 * (2048 * 2048 * 2 + 2 * 2048 * 1024 + 3 * 2048 * 6144) + 151936 * 2048
    assert lora_params(shape) == 28 * 16 * (4096 + 2 * (2048 + 1024) + 4096 + 3 * (2048 + 6144))
