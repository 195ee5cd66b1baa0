"""The head in vocabulary shards on CUDA: loss and every gradient equal plain HF on the GPU (float32, the measured
plan), and a bfloat16 model's loss matches HF's. Skipped without a GPU."""

from __future__ import annotations

import copy

import pytest
import torch

from accelerate_roundpipe import RoundPipeConfig, wrap_model

from split_helpers import assert_close, build_model, cuda_reference, make_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("tied", [False, True])
def test_shards_on_cuda_match_hf(tied):
    model = build_model("qwen3", num_hidden_layers=3, tie_word_embeddings=tied).float()
    batch = make_batch("mixed")
    ref_loss, ref_grads = cuda_reference(model, batch)

    engine = wrap_model(copy.deepcopy(model), RoundPipeConfig(devices=["cuda:0"], num_microbatches=3, seed=0,
                                                              kernels="none", head_shards=3))
    try:
        for _ in range(2):  # the second pass runs the measured plan
            loss = engine.forward_backward(**batch)
            engine.synchronize()
            assert_close(loss, ref_loss.detach().cpu(), "loss", rtol=1e-5)
            for name, p in engine.named_parameters():
                assert_close(p.grad, ref_grads[name], f"grad of {name}", rtol=1e-4)
            engine.zero_grad()
    finally:
        engine.close()


def test_bfloat16_shards_give_hf_loss():
    model = build_model("llama", num_hidden_layers=2).to(torch.bfloat16)
    batch = make_batch("right")
    reference = copy.deepcopy(model).cuda()
    with torch.no_grad():
        ref_loss = reference(**{k: v.cuda() for k, v in batch.items()}).loss.float().cpu()
    engine = wrap_model(copy.deepcopy(model), RoundPipeConfig(devices=["cuda:0"], num_microbatches=1, seed=0,
                                                              kernels="none", head_shards=4))
    try:
        loss = engine.forward_backward(**batch)
        engine.synchronize()
        assert_close(loss.float(), ref_loss, "bf16 loss", rtol=1e-2)
        assert all(torch.isfinite(p.grad).all() for _, p in engine.named_parameters())
    finally:
        engine.close()
