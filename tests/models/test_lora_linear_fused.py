"""PEFT's LoRA on linear layers with the product added inside one GEMM ([Note: LoRA added in the GEMM] in
`compat/peft_linear.py`), against PEFT's own forward in float64: one decoder layer's copy in every case the fused
forward takes and every case it leaves to PEFT, then the engine on two CPU workers against plain PEFT."""

from __future__ import annotations

import copy

import pytest
import torch

from accelerate_roundpipe import RoundPipeConfig, wrap_model
from accelerate_roundpipe.compat import peft_linear

from split_helpers import assert_close, build_model, lora_model, make_batch, reference_loss

peft = pytest.importorskip("peft")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture
def fused_calls(monkeypatch):
    """How many LoRA linears computed the fused sum (the rest ran PEFT's forward)."""
    calls = []
    real = peft_linear._vanilla_adapters

    def spy(module, x):
        adapters = real(module, x)
        calls.append(adapters is not None)
        return adapters

    monkeypatch.setattr(peft_linear, "_vanilla_adapters", spy)
    return calls


def _peft_model(**settings):
    """A PEFT LoRA model (r=4) over the tiny float64 Llama, its B factors random (PEFT starts them at zero)."""
    model = peft.get_peft_model(build_model("llama"), peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS,
                                                                    **settings))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, dtype=p.dtype, generator=torch.Generator().manual_seed(3)))
    return model


def _layer_inputs(model, seed: int = 0):
    """A decoder layer of `model` and the arguments its model passes it, for a random batch."""
    captured = {}
    layer = model.get_base_model().model.layers[0]

    def grab(module, args, kwargs):
        captured["args"], captured["kwargs"] = args, kwargs

    handle = layer.register_forward_pre_hook(grab, with_kwargs=True)
    with torch.no_grad():
        model(**make_batch("left", seed), use_cache=False)
    handle.remove()
    hidden = torch.randn(captured["args"][0].shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    return layer, hidden, captured["kwargs"]


def _run(layer, hidden, kwargs, seed: int = 1):
    """The layer's output and the gradients of its input and trainable parameters, for a random output gradient."""
    x = hidden.clone().requires_grad_(True)
    torch.manual_seed(seed)  # the LoRA dropout's draws
    out = layer(x, **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(seed)))
    grads = {name: p.grad.clone() for name, p in layer.named_parameters() if p.grad is not None}
    return out.detach(), x.grad, grads


def _compare(model, fused_calls, expect_fused: bool, train: bool = False, adapters_used: bool = True):
    layer, hidden, kwargs = _layer_inputs(model)
    layer.train(train)
    fused = copy.deepcopy(layer)
    assert peft_linear.fuse_lora_adds(fused) == sum(type(m).__name__ == "Linear" and hasattr(m, "lora_A")
                                                    for m in fused.modules())
    expected = _run(layer, hidden, kwargs)
    fused_calls.clear()
    got = _run(fused, hidden, kwargs)
    assert fused_calls and all(fused_calls) == expect_fused and any(fused_calls) == expect_fused
    assert_close(got[0], expected[0], "layer output")
    assert_close(got[1], expected[1], "input gradient")
    assert got[2].keys() == expected[2].keys() and bool(got[2]) == adapters_used
    for name in expected[2]:
        assert_close(got[2][name], expected[2][name], f"gradient of {name}")


def test_fused_sum_equals_peft(fused_calls):
    _compare(lora_model("llama", TARGETS), fused_calls, expect_fused=True)


def test_fused_sum_with_dropout_draws_what_peft_draws(fused_calls):
    _compare(_peft_model(lora_dropout=0.3), fused_calls, expect_fused=True, train=True)


def test_two_active_adapters_are_both_added(fused_calls):
    model = lora_model("llama", TARGETS)
    model.add_adapter("second", peft.LoraConfig(r=2, lora_alpha=3, target_modules=TARGETS))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B.second" in name:
                p.copy_(0.1 * torch.randn(p.shape, dtype=p.dtype, generator=torch.Generator().manual_seed(5)))
    model.base_model.set_adapter(["default", "second"])
    _compare(model, fused_calls, expect_fused=True)


@pytest.mark.parametrize("case", ["dora", "lora_bias", "disabled", "float32_adapters"])
def test_cases_left_to_peft(fused_calls, case):
    """What the fused forward would compute differently runs PEFT's own forward, with the same numbers."""
    settings = {"dora": dict(use_dora=True), "lora_bias": dict(lora_bias=True)}.get(case, {})
    model = _peft_model(**settings)
    if case == "float32_adapters":  # PEFT casts the input to the adapters' dtype and promotes the sum
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.data = p.data.float()
        layer, hidden, kwargs = _layer_inputs(model)
        fused = copy.deepcopy(layer)
        peft_linear.fuse_lora_adds(fused)
        fused_calls.clear()
        assert_close(_run(fused, hidden, kwargs)[0], _run(layer, hidden, kwargs)[0], "layer output")
        assert fused_calls and not any(fused_calls)
        return
    if case == "disabled":
        for module in model.modules():
            if hasattr(module, "lora_A"):
                module._disable_adapters = True
    _compare(model, fused_calls, expect_fused=False, adapters_used=case != "disabled")


def test_engine_trains_lora_as_peft_does(fused_calls):
    """Two CPU workers, two micro-batches: the loss and every adapter's gradient are plain PEFT's, and the layer
    copies computed the fused sum."""
    reference = lora_model("llama", TARGETS)
    model = copy.deepcopy(reference)
    batch = make_batch("left")
    expected = reference_loss(reference, batch)
    expected.backward()
    engine = wrap_model(model, RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=2))
    try:
        fused_calls.clear()
        loss = engine.forward_backward(**batch)
        engine.synchronize()
        assert fused_calls and all(fused_calls)
        assert_close(loss, expected.detach(), "loss")
        want = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
        got = {n: p.grad for n, p in engine.named_parameters() if p.requires_grad}
        assert want.keys() == got.keys() and want
        for name in want:
            assert_close(got[name], want[name], f"gradient of {name}")
    finally:
        engine.close()
