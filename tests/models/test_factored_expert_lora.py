"""[Note: factored LoRA on experts] (`compat/peft_experts.py`): the experts' LoRA computed through its factors.

- On one experts module (Qwen3-MoE's layout, and GPT-OSS's: transposed weights, biases, interleaved gate), in
  float64, the factored forward gives PEFT's output and the gradients of the input, the factors and the routing
  weights.
- On the engine, the layer copies take the factored path (counted) and train exactly as with PEFT's own computation
  (the parity against plain PEFT is test_lora_on_experts.py's, which runs through this path).
- Where it does not apply (two active adapters, an implementation other than grouped_mm/eager), PEFT's computation
  runs and the numbers are plain PEFT's.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_lora_on_experts import EXPERT_PARAMETERS, lora_on_experts, randomize_lora_b, tiny_moe, train_both

from accelerate_roundpipe.compat import peft_experts, peft_internals
from accelerate_roundpipe.compat.hf_experts import set_implementation

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


def _experts_with_lora(model_type: str):
    model = lora_on_experts(model_type, "target_parameters", aux=False)
    outer = model.base_model.model.model.layers[0].mlp.experts
    return model, outer


def _route(model, tokens: int, seed: int):
    config = model.config
    experts = config.num_experts if hasattr(config, "num_experts") else config.num_local_experts
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, config.hidden_size, generator=generator, dtype=torch.float64, requires_grad=True)
    scores = torch.randn(tokens, experts, generator=generator, dtype=torch.float64)
    weights, index = torch.topk(scores.softmax(-1), config.num_experts_per_tok, dim=-1)
    return hidden, index, weights.detach().requires_grad_(True)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_factored_forward_equals_peft_on_one_experts_module(model_type):
    model, outer = _experts_with_lora(model_type)
    experts = outer
    while isinstance(experts, peft.tuners.lora.layer.ParamWrapper):
        experts = experts.base_layer
    factors = peft_internals.chain_factors(outer, experts)
    assert factors is not None and set(factors) == {"gate_up_proj", "down_proj"}
    hidden, index, weights = _route(model, tokens=24, seed=5)
    hidden_ref, weights_ref = hidden.detach().clone().requires_grad_(True), weights.detach().clone().requires_grad_()

    lora = [p for n, p in outer.named_parameters() if "lora_" in n]
    assert len(lora) == 4
    got = peft_experts.factored_experts_forward(experts, factors, hidden, index, weights)
    cotangent = torch.randn(got.shape, generator=torch.Generator().manual_seed(7), dtype=got.dtype)
    # ours first: PEFT's parametrization, registered and removed in its forward, bumps the weights' versions
    grads = torch.autograd.grad(got, [hidden, weights, *lora], cotangent)
    expected = outer(hidden_ref, index, weights_ref)  # the user's module: PEFT's parametrized weights, eager loop
    expected_grads = torch.autograd.grad(expected, [hidden_ref, weights_ref, *lora], cotangent)
    scale = float(expected.detach().abs().max())
    assert float((got.detach() - expected.detach()).abs().max()) <= 1e-12 * scale
    for name, g, e in zip(["hidden", "routing weights", "A0", "B0", "A1", "B1"], grads, expected_grads):
        assert float((g - e).abs().max()) <= 1e-11 * max(float(e.abs().max()), 1e-30), name


def _count_factored(monkeypatch) -> list[int]:
    calls = [0]
    original = peft_experts.factored_experts_forward

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(peft_experts, "factored_experts_forward", counted)
    return calls


def _max_difference(a: dict, b: dict) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def test_the_pair_gathers_are_each_other_s_adjoint_and_have_exact_gradients():
    # The experts' rows in expert order and back (`_PairRows`, `_PairSum`) have hand-written backwards in place of
    # autograd's index backward: checked against finite differences in float64, and against the plain gather.
    torch.manual_seed(0)
    tokens, top_k, width = 5, 3, 4
    order = torch.randperm(tokens * top_k)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    hidden = torch.randn(tokens, width, dtype=torch.float64, requires_grad=True)
    rows = torch.randn(tokens * top_k, width, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda h: peft_experts._PairRows.apply(h, order, inverse, top_k), (hidden,))
    assert torch.autograd.gradcheck(lambda r: peft_experts._PairSum.apply(r, order, inverse, top_k), (rows,))
    assert torch.autograd.gradgradcheck(lambda h: peft_experts._PairRows.apply(h, order, inverse, top_k), (hidden,))
    assert torch.equal(peft_experts._PairRows.apply(hidden, order, inverse, top_k), hidden[order // top_k])
    plain = rows[inverse].view(tokens, top_k, width).sum(1)
    assert torch.equal(peft_experts._PairSum.apply(rows, order, inverse, top_k), plain)


def test_engine_layer_copies_take_the_factored_path_and_match_peft_s_computation(monkeypatch):
    model = lora_on_experts("qwen3_moe", "target_modules", aux=True)
    second = copy.deepcopy(model)
    calls = _count_factored(monkeypatch)
    _, factored_losses, factored_grads = train_both(model)
    # 2 layers x 2 micro-batches x 2 steps, each forward and its recomputation in the backward
    assert calls[0] >= 8, f"the factored path ran {calls[0]} times"

    monkeypatch.setattr(peft_experts, "enabled", False)
    calls[0] = 0
    _, merged_losses, merged_grads = train_both(second)
    assert calls[0] == 0
    for (f, _), (m, _) in zip(factored_losses, merged_losses):
        assert abs(float(f) - float(m)) <= 1e-12 * abs(float(m))
    engine_factored, engine_merged = factored_grads[0][0], merged_grads[0][0]
    assert _max_difference(engine_factored, engine_merged) <= 1e-10


def test_two_active_adapters_run_peft_s_own_computation(monkeypatch):
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], target_parameters=EXPERT_PARAMETERS)
    model = peft.get_peft_model(tiny_moe("qwen3_moe", aux=False), config)
    model.add_adapter("second", copy.deepcopy(config))
    randomize_lora_b(model)
    model.base_model.set_adapter(["default", "second"])
    for name, parameter in model.named_parameters():
        parameter.requires_grad_("lora_" in name)
    calls = _count_factored(monkeypatch)
    _, losses, grads = train_both(model)
    assert calls[0] == 0
    for step, (loss, expected) in enumerate(losses):
        assert abs(float(loss) - float(expected)) <= 1e-10 * abs(float(expected)), f"step {step}"
    engine, plain = grads[0]
    assert engine.keys() == plain.keys() and any("second" in n for n in engine)
    assert _max_difference(engine, plain) <= 1e-9 * max(float(t.abs().max()) for t in plain.values())


def test_other_implementations_are_left_to_peft():
    model, outer = _experts_with_lora("qwen3_moe")
    experts = outer.base_layer.base_layer
    assert peft_internals.chain_factors(outer, experts) is not None
    set_implementation(experts, "batched_mm")
    assert peft_internals.chain_factors(outer, experts) is None
    set_implementation(experts, "eager")
    outer.enable_adapters(False)  # PEFT's switch, read by the chain
    assert peft_internals.chain_factors(outer, experts) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch's grouped GEMM)")
def test_factored_forward_on_the_grouped_gemm_matches_peft_in_float32():
    model, outer = _experts_with_lora("qwen3_moe")
    model = model.to("cuda", torch.float32)
    experts = outer.base_layer.base_layer
    set_implementation(experts, "grouped_mm")
    factors = peft_internals.chain_factors(outer, experts)
    hidden, index, weights = _route(model, tokens=64, seed=9)
    hidden, index, weights = (t.detach().to("cuda") for t in (hidden, index, weights))
    hidden, weights = hidden.float().requires_grad_(), weights.float()
    lora = [p for n, p in outer.named_parameters() if "lora_" in n]
    got = peft_experts.factored_experts_forward(experts, factors, hidden, index, weights)
    g = torch.autograd.grad(got.sum(), lora)
    expected = outer(hidden, index, weights)
    e = torch.autograd.grad(expected.sum(), lora)
    assert float((got.detach() - expected.detach()).abs().max()) <= 1e-4 * float(expected.detach().abs().max())
    for a, b in zip(g, e):
        assert float((a - b).abs().max()) <= 1e-3 * float(b.abs().max())
