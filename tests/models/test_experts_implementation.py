"""Which experts implementation the engine's layer copies run ([Note: experts implementation of layer copies] in
`models/layers.py`): the one the model's config names (transformers 5: "grouped_mm" by default, or what
`set_experts_implementation` chose, also after the copies were made), "eager" where that one has no kernel for the
copy's dtype (grouped_mm in float64), never Liger's fused experts in place of the config's choice; and every
implementation gives plain HF's loss and gradients (float32 on CPU, where torch 2.13 has grouped_mm and batched_mm).
"""

from __future__ import annotations

import collections
import copy
import importlib.machinery
import logging
import sys
import types

import pytest
import torch
from torch import nn

from accelerate_roundpipe import RoundPipeConfig, wrap_model
from accelerate_roundpipe.compat import peft_experts
from accelerate_roundpipe.compat.hf_experts import implementation_of
from accelerate_roundpipe.models import layers as layers_module

from split_helpers import assert_close, build_model, make_batch, reference_loss

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
moe = pytest.importorskip("transformers.integrations.moe")

IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NUM_MB = 2


@pytest.fixture
def dispatched(monkeypatch) -> collections.Counter:
    """How many experts calls ran each implementation, counted at transformers' dispatch (every
    `@use_experts_implementation` forward asks `ALL_EXPERTS_FUNCTIONS.get_interface` for its function) and, for
    LoRA on the experts, at the factored forward that takes its place ([Note: factored LoRA on experts]: it runs
    grouped_mm's kernel or eager's loop by the same name)."""
    counts: collections.Counter = collections.Counter()
    interface = moe.ALL_EXPERTS_FUNCTIONS
    original = type(interface).get_interface.__get__(interface)

    def counted(name, default):
        counts[name] += 1
        return original(name, default)

    factored = peft_experts.factored_experts_forward

    def counted_factored(experts, *args):
        counts[implementation_of(experts)] += 1
        return factored(experts, *args)

    monkeypatch.setattr(interface, "get_interface", counted, raising=False)
    monkeypatch.setattr(peft_experts, "factored_experts_forward", counted_factored)
    return counts


def moe_model(dtype: torch.dtype, implementation: str = "grouped_mm", lora: bool = False) -> nn.Module:
    """A 2-layer Qwen3-MoE (hidden 64, 4 experts of 32, random weights) in `dtype`, experts run by
    `implementation`; with `lora`, PEFT LoRA on the usual targets (which reach the experts' fused parameters through
    PEFT's ParamWrapper), its B random."""
    model = build_model("qwen3_moe", output_router_logits=False).to(dtype)
    model.set_experts_implementation(implementation)
    if not lora:
        return model
    model = peft.get_peft_model(model, peft.LoraConfig(r=2, lora_alpha=4, target_modules=LORA_TARGETS))
    assert sum(type(m).__name__ == "ParamWrapper" for m in model.modules()) == 4  # gate_up and down, 2 layers
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(0.1 * torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))
    return model


def set_implementation(model: nn.Module, name: str) -> None:
    (model.get_base_model() if hasattr(model, "get_base_model") else model).set_experts_implementation(name)


def trainable_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}


def plain_loss_and_grads(model: nn.Module, batch: dict) -> tuple[torch.Tensor, dict]:
    """HF's loss (in the model's dtype: HF's own upcasts to float32) and gradients."""
    loss = reference_loss(model, batch)
    loss.backward()
    return loss.detach(), trainable_grads(model)


def engine_loss_and_grads(engine, batch: dict) -> tuple[torch.Tensor, dict]:
    loss = engine.forward_backward(**batch)
    engine.synchronize()
    grads = trainable_grads(engine)
    engine.zero_grad()
    return loss, grads


def assert_grads_close(actual: dict, expected: dict, rtol: float, what: str) -> None:
    """Each gradient at the scale of its own largest element (a millionth of the largest of all at least)."""
    assert actual.keys() == expected.keys()
    largest = max(float(g.abs().max()) for g in expected.values())
    for name, grad in expected.items():
        scale = max(float(grad.abs().max()), 1e-6 * largest)
        error = float((actual[name] - grad).abs().max()) / scale
        assert error <= rtol, f"{what}: gradient of {name}, relative error {error:.2e}"


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_layer_copies_follow_the_models_experts_implementation_after_they_are_made(lora, dispatched):
    """A device's layer copy is made at its first run, config included: an implementation chosen on the model after
    that (`set_experts_implementation`, as HF documents it) must reach the copies, as it reaches plain HF."""
    model = moe_model(torch.float32, "grouped_mm", lora=lora)
    batch = make_batch("left")
    engine = wrap_model(model, RoundPipeConfig(devices=["cpu"], num_microbatches=NUM_MB))
    try:
        calls = 2 * NUM_MB * 2  # layers x micro-batches x (forward, recomputation)
        engine.forward_backward(**batch)
        engine.synchronize()
        assert dispatched == {"grouped_mm": calls}
        for name in ("eager", "batched_mm", "grouped_mm"):
            dispatched.clear()
            set_implementation(model, name)
            engine.forward_backward(**batch)
            engine.synchronize()
            assert dispatched == {name: calls}, f"after set_experts_implementation({name!r})"
    finally:
        engine.close()


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_every_experts_implementation_gives_plain_hfs_loss_and_gradients(implementation, lora, dispatched):
    """float32 on a CPU worker, two micro-batches: the engine's copies run the implementation the model names, and
    its loss and gradients are plain HF's (PEFT's with LoRA) computed with the eager loop, to float32 rounding (the
    implementations sum the experts' products in other orders)."""
    model = moe_model(torch.float32, "eager", lora=lora)
    batch = make_batch("left")
    expected_loss, expected_grads = plain_loss_and_grads(copy.deepcopy(model), batch)
    set_implementation(model, implementation)
    dispatched.clear()
    engine = wrap_model(model, RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=NUM_MB))
    try:
        loss, grads = engine_loss_and_grads(engine, batch)
    finally:
        engine.close()
    assert set(dispatched) == {implementation}
    assert_close(loss, expected_loss, f"loss with {implementation}", rtol=1e-6)
    assert_grads_close(grads, expected_grads, 1e-4, implementation)


def test_float64_copies_run_eager_where_grouped_mm_has_no_kernel(dispatched, monkeypatch, caplog):
    """transformers' default, grouped_mm, has no float64 kernel (plain HF fails in its first experts call): the
    engine's float64 copies run the eager loop instead, say so once, and give plain HF's eager loss and gradients
    exactly; the user's model still names grouped_mm."""
    monkeypatch.setattr(layers_module, "_SAID", set(), raising=False)
    model = moe_model(torch.float64, "grouped_mm")
    batch = make_batch("left")
    with pytest.raises(RuntimeError, match="Double"):
        copy.deepcopy(model)(**batch)
    reference = copy.deepcopy(model)
    reference.set_experts_implementation("eager")
    expected_loss, expected_grads = plain_loss_and_grads(reference, batch)
    dispatched.clear()
    engine = wrap_model(model, RoundPipeConfig(devices=["cpu"], num_microbatches=NUM_MB))
    try:
        with caplog.at_level(logging.WARNING, logger=layers_module.__name__):
            loss, grads = engine_loss_and_grads(engine, batch)
    finally:
        engine.close()
    assert set(dispatched) == {"eager"}
    assert_close(loss, expected_loss, "float64 loss")
    assert_grads_close(grads, expected_grads, 1e-10, "float64")
    assert model.config._experts_implementation == "grouped_mm"
    said = [r.getMessage() for r in caplog.records if "experts_implementation" in r.getMessage()]
    assert len(said) == 1 and "'eager'" in said[0] and "float64" in said[0], said


def fake_liger(monkeypatch) -> None:
    """Liger-Kernel faked (a CPU machine has neither it nor a GPU): its instance patch binds a forward and a name
    on the experts (as `_patch_swiglu_module(decoder_layer.mlp.experts, LigerExperts)` does) and on the norms."""

    def liger_experts_forward(self, hidden_states, top_k_index, top_k_weights):
        raise AssertionError("Liger's fused experts ran")

    def apply_to_instance(model, **kwargs):
        for layer in model.model.layers:
            for module in (layer.mlp.experts, layer.input_layernorm):
                forward = liger_experts_forward if module is layer.mlp.experts else type(module).forward
                module.forward = types.MethodType(forward, module)
                module._get_name = types.MethodType(lambda self: "Liger", module)

    liger = types.ModuleType("liger_kernel")
    liger.__spec__ = importlib.machinery.ModuleSpec("liger_kernel", None)
    liger_transformers = types.ModuleType("liger_kernel.transformers")
    liger_transformers._apply_liger_kernel_to_instance = apply_to_instance
    monkey_patch = types.ModuleType("liger_kernel.transformers.monkey_patch")
    monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN = {"qwen3_moe": apply_to_instance}
    for name, module in (("liger_kernel", liger), ("liger_kernel.transformers", liger_transformers),
                         ("liger_kernel.transformers.monkey_patch", monkey_patch)):
        monkeypatch.setitem(sys.modules, name, module)


def test_liger_kernels_leave_the_experts_to_the_models_implementation(monkeypatch, dispatched):
    """On GPUs the engine applies Liger-Kernel (`kernels="auto"`), whose instance patch replaced the experts'
    forward with its fused MoE, so the model's experts_implementation was never read. The experts get transformers'
    forward back (the config's implementation runs); Liger's patch of every other module stays."""
    from accelerate_roundpipe.models.kernels import apply_fused_kernels

    fake_liger(monkeypatch)
    model = moe_model(torch.float32, "grouped_mm")
    assert apply_fused_kernels(model, "auto", [torch.device("cuda", 0)])
    layers = model.model.layers
    assert all("forward" in vars(layer.input_layernorm) for layer in layers)
    assert all(not {"forward", "_get_name"} & set(vars(layer.mlp.experts)) for layer in layers)
    batch = make_batch("left")
    expected = copy.deepcopy(model)(**batch).loss
    dispatched.clear()
    engine = wrap_model(model, RoundPipeConfig(devices=["cpu"], num_microbatches=1))
    try:
        loss = engine.forward_backward(**batch)
    finally:
        engine.close()
    assert set(dispatched) == {"grouped_mm"}
    assert_close(loss, expected.detach(), "loss after the Liger patch", rtol=1e-6)


def test_a_changed_experts_dispatch_is_refused_with_the_version_to_pin(monkeypatch):
    """If transformers' config no longer keeps the experts implementation where the copies set it, wrapping a MoE
    model says so (`LibraryChangedError`) instead of setting an attribute nothing reads."""
    from accelerate_roundpipe.compat import LibraryChangedError

    model = moe_model(torch.float32)
    monkeypatch.setattr(transformers.PretrainedConfig, "_experts_implementation",
                        property(lambda self: self.__dict__.get("_experts_choice")))
    with pytest.raises(LibraryChangedError, match=r"transformers .*no longer looks up `_experts_implementation_inter"):
        wrap_model(model, RoundPipeConfig(devices=["cpu"]))
