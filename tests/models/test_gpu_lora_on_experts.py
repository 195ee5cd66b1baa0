"""LoRA on MoE experts on a CUDA worker, with the fused kernels the engine applies there (Liger when installed; its
instance patch is undone on PEFT's wrappers of the experts: [Note: LoRA on parameters in layer copies]): the losses
of three AdamW steps are plain PEFT's on the same GPU (float32)."""

from __future__ import annotations

import copy

import pytest
import torch
from test_lora_on_experts import lora_on_experts, micro_batched_loss, trainable

from accelerate_roundpipe import RoundPipeConfig, wrap_model

from split_helpers import make_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("way", ["target_modules", "target_parameters"])
def test_lora_on_experts_trains_on_a_gpu_as_plain_peft(way):
    model = lora_on_experts("qwen3_moe", way, aux=True).float()
    reference = copy.deepcopy(model).cuda()
    engine = wrap_model(model, RoundPipeConfig(devices=["cuda:0"], num_microbatches=2, async_optimizer=False))
    optimizer = engine.wrap_optimizer(torch.optim.AdamW(list(trainable(engine).values()), lr=1e-2))
    reference_optimizer = torch.optim.AdamW(list(trainable(reference).values()), lr=1e-2)
    try:
        for step in range(3):
            batch = make_batch("left" if step % 2 == 0 else "mixed", seed=step)
            loss = float(engine.forward_backward(**batch))
            expected = micro_batched_loss(reference, {k: v.cuda() for k, v in batch.items()}, 2)
            expected.backward()
            assert abs(loss - float(expected)) <= 1e-4 * abs(float(expected)), (step, loss, float(expected))
            optimizer.step()
            optimizer.zero_grad()
            reference_optimizer.step()
            reference_optimizer.zero_grad()
        engine.synchronize()
    finally:
        engine.close()
