"""A Hugging Face model on the engine on CUDA: loss and gradients equal plain HF on the GPU (float32), with and
without Liger kernels, with the planned partition and with every layer in the fused stage. Skipped without a GPU."""

from __future__ import annotations

import copy

import pytest
import torch

from accelerate_roundpipe import RoundPipeConfig, wrap_model
from accelerate_roundpipe.models.kernels import liger_available

from split_helpers import assert_close, build_model, cuda_reference, make_batch, reference_loss

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("whole_model_fused", [False, True])
@pytest.mark.parametrize("kernels", ["none", "auto"])
def test_qwen3_on_cuda_matches_hf(kernels, whole_model_fused):
    if kernels == "auto" and not liger_available():
        pytest.skip("Liger-Kernel is not installed")
    model = build_model("qwen3", num_hidden_layers=3, tie_word_embeddings=True).float()
    batch = make_batch("none")
    ref_loss, ref_grads = cuda_reference(model, batch)

    stages = {"backward_stages": [3 + 2]} if whole_model_fused else {}
    engine = wrap_model(copy.deepcopy(model), RoundPipeConfig(devices=["cuda:0"], num_microbatches=3, seed=0,
                                                              kernels=kernels, **stages))
    assert engine.fused_kernels == (kernels == "auto")
    loss = engine.forward_backward(**batch)
    engine.synchronize()
    assert_close(loss, ref_loss.detach().cpu(), "loss", rtol=1e-5)
    grads = {n: p.grad for n, p in engine.named_parameters()}
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert_close(grad, ref_grads[name], f"grad of {name}", rtol=2e-4)
    engine.close()


def test_measured_plan_on_cuda_puts_a_small_model_in_one_fused_stage():
    """[Note: measured plan] on a GPU: the first pass measures (activation bytes from the allocator, times from CUDA
    events), the second runs re-planned (everything fits: one fused stage, no recomputation) with exact gradients."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = build_model("qwen3", num_hidden_layers=3).float()
    batch = make_batch("none")
    reference = copy.deepcopy(model).cuda()
    reference_loss(reference, {k: v.cuda() for k, v in batch.items()}).backward()
    ref_grads = {n: 2 * p.grad.cpu() for n, p in reference.named_parameters()}  # two passes accumulate
    engine = wrap_model(copy.deepcopy(model), RoundPipeConfig(devices=["cuda:0"], num_microbatches=3, seed=0,
                                                              kernels="none"))
    assert engine.config.resolved_plan == "measured"
    engine.forward_backward(**batch)
    first = engine.partition
    engine.forward_backward(**batch)
    engine.synchronize()
    assert first != engine.partition and engine.partition.forward == ()
    costs = engine.layer_costs
    assert all(a > 0 for a in costs.act_bytes[1:]) and all(t > 0 for t in costs.forward_s)
    for name, p in engine.named_parameters():
        assert_close(p.grad, ref_grads[name], f"grad of {name}", rtol=2e-4)
    engine.close()


def test_tiled_mlp_on_cuda_matches_hf_and_no_task_memory_outlives_the_pass():
    """`mlp_chunk_tokens` on a GPU gives HF's loss and gradients; after synchronize() the device holds no parameter
    flats or gradient buffers of finished tasks (the layer copies are unbound, [Note: bounded run-ahead])."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = build_model("qwen3", num_hidden_layers=3).float()
    batch = make_batch("none")
    reference = copy.deepcopy(model).cuda()
    ref_loss = reference_loss(reference, {k: v.cuda() for k, v in batch.items()})
    ref_loss.backward()
    ref_grads = {n: p.grad.cpu() for n, p in reference.named_parameters()}
    del reference
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(0)
    engine = wrap_model(copy.deepcopy(model), RoundPipeConfig(devices=["cuda:0"], num_microbatches=1, seed=0,
                                                              kernels="none", plan="static", mlp_chunk_tokens=5))
    loss = engine.forward_backward(**batch)
    engine.synchronize()
    assert_close(loss, ref_loss.detach().cpu(), "loss", rtol=1e-5)
    for name, p in engine.named_parameters():
        assert_close(p.grad, ref_grads[name], f"grad of {name}", rtol=2e-4)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    torch.cuda.synchronize()
    # cuBLAS keeps a workspace per (handle, stream) in the caching allocator for the life of the stream (32 MiB on
    # Hopper for each of the worker's streams that ran a matmul): library state, not task memory. Clear it so the
    # bound below measures what it means to, the buffers of finished tasks.
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()  # also retires blocks whose frees waited on other streams' events
    assert torch.cuda.memory_allocated(0) - before < param_bytes  # not every layer's parameters and gradients
    engine.close()
