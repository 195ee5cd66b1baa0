"""Tiled MLP: the same outputs and gradients as the plain MLP (float64), in isolation and inside the engine."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from accelerate_roundpipe import RoundPipeConfig, wrap_model
from accelerate_roundpipe.models import tiled_mlp
from accelerate_roundpipe.models.tiled_mlp import tile_mlps, tileable

from split_helpers import assert_close, build_model, lora_model, make_batch, reference_loss


def _llama_mlp_layer():
    return build_model("llama").model.layers[0]


@pytest.mark.parametrize("chunk", [1, 5, 7, 1000])
@pytest.mark.parametrize("input_grad", [True, False])
def test_tiled_mlp_equals_plain(chunk, input_grad):
    layer = _llama_mlp_layer()
    tiled = copy.deepcopy(layer)
    assert tile_mlps([tiled], chunk) == 1
    x = torch.randn(3, 12, 64, dtype=torch.float64, requires_grad=input_grad)
    grad_out = torch.randn(3, 12, 64, dtype=torch.float64)
    outputs, grads = [], []
    down_calls = []
    tiled.mlp.down_proj.register_forward_hook(lambda *args: down_calls.append(1))
    for module in (layer.mlp, tiled.mlp):
        xi = x.detach().clone().requires_grad_(input_grad)
        out = module(xi)
        out.backward(grad_out)
        outputs.append(out.detach())
        grads.append([xi.grad] + [p.grad for p in module.parameters()])
    # Tiled: each chunk runs once in the forward and once more (recomputed) in the backward; else once in all.
    assert len(down_calls) == (2 * math.ceil(36 / chunk) if chunk < 36 else 1)
    assert_close(outputs[1], outputs[0], "output")
    for index, (tiled_grad, plain_grad) in enumerate(zip(grads[1], grads[0])):
        if plain_grad is None:
            assert tiled_grad is None
        else:
            assert_close(tiled_grad, plain_grad, f"gradient {index}")
    assert tiled.mlp.forward.__func__ is tiled_mlp._tiled_forward
    assert layer.mlp.forward.__func__ is type(layer.mlp).forward  # the original is left alone
    twin = copy.deepcopy(tiled)  # per-device copies: bound methods, so each copy calls its own MLP
    assert twin.mlp.forward.__self__ is twin.mlp and twin.mlp._roundpipe_untiled_forward.__self__ is twin.mlp


def test_only_dense_mlps_without_dropout_are_tiled():
    assert tileable(_llama_mlp_layer().mlp)
    dropout_mlp = nn.Module()
    dropout_mlp.fc1, dropout_mlp.fc2, dropout_mlp.drop = nn.Linear(2, 4), nn.Linear(4, 2), nn.Dropout(0.1)
    assert not tileable(dropout_mlp)
    moe = build_model("qwen3_moe").model.layers[0] if "qwen3_moe" in _families() else None
    if moe is not None:
        assert tile_mlps([moe], 4) == 0  # a router-driven block is left alone
    with pytest.raises(ValueError, match="mlp_chunk_tokens"):
        tile_mlps([_llama_mlp_layer()], 0)


def _families():
    from split_helpers import available_families

    return available_families()


@pytest.mark.parametrize("tied", [False, True])
def test_engine_with_tiled_mlps_equals_hf(tied, monkeypatch):
    model = build_model("llama", tie_word_embeddings=tied)
    batch = make_batch("left")
    reference = copy.deepcopy(model)
    ref_loss = reference_loss(reference, batch)
    ref_loss.backward()
    engine = wrap_model(model, RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=2, mlp_chunk_tokens=5))
    assert all("_roundpipe_untiled_forward" in layer.mlp.__dict__ for layer in model.model.layers)
    tiled_runs = []
    original_apply = tiled_mlp._TiledMLPFunction.apply
    monkeypatch.setattr(tiled_mlp._TiledMLPFunction, "apply",
                        lambda *args: tiled_runs.append(1) or original_apply(*args))
    loss = engine.forward_backward(**batch)
    engine.synchronize()
    # The workers' layer copies ran tiled: every decoder layer on each of the 2 micro-batches.
    assert len(tiled_runs) == 2 * len(model.model.layers)
    assert_close(loss, ref_loss.detach(), "loss")
    ref_grads = dict(reference.named_parameters())
    for name, p in engine.named_parameters():
        assert_close(p.grad, ref_grads[name].grad, f"grad of {name}")
    engine.close()


def test_lora_adapters_inside_a_tiled_mlp_get_exact_gradients():
    pytest.importorskip("peft")
    model = lora_model("llama", ["gate_proj", "up_proj", "down_proj"])
    batch = make_batch("right")
    reference = copy.deepcopy(model)
    ref_loss = reference_loss(reference, batch)
    ref_loss.backward()
    engine = wrap_model(model, RoundPipeConfig(devices=["cpu"], num_microbatches=1, mlp_chunk_tokens=7))
    loss = engine.forward_backward(**batch)
    engine.synchronize()
    assert_close(loss, ref_loss.detach(), "loss")
    ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    grads = {n: p.grad for n, p in engine.named_parameters() if p.requires_grad}
    assert grads.keys() == ref_grads.keys() and any("mlp" in n for n in grads)
    for name, grad in grads.items():
        assert_close(grad, ref_grads[name], f"grad of {name}")
    engine.close()
