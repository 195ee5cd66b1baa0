"""LoRA on the experts of mixture-of-experts models, on the engine, against plain PEFT in float64.

PEFT reaches the experts' fused 3-D parameters (`mlp.experts.gate_up_proj`, `down_proj`) two ways, both through its
`ParamWrapper` ([Note: LoRA on parameters in layer copies] in `compat/peft_internals.py`): the usual
`target_modules` names, which PEFT maps onto the fused parameters for some families on transformers 5 (Qwen3-MoE,
OLMoE, DeepSeek-V3, ...), and `target_parameters` (GPT-OSS's recipe; any family). Each case trains on two CPU
workers with two micro-batches: the loss, the gradients of the adapters and of the router (trained too, PEFT's
`modules_to_save`), the weights after AdamW steps, `merge_and_unload` and the saved adapter files are plain PEFT's.

The reference runs plain PEFT one micro-batch at a time (the engine's rows, its whole-batch label count): the
router aux loss of several micro-batches is each micro-batch's own, weighted by its share of the batch's tokens
([Note: router statistics] in `models/router_aux.py`), so the comparison holds with the aux loss on, exactly.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from decoder_catalog import OVERRIDES, SHRINK
from torch import nn

from accelerate_roundpipe import RoundPipeConfig, wrap_model

from split_helpers import VOCAB, assert_close, make_batch, switch_aux_loss

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

USUAL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# Smaller than the catalog's tiny configs: hidden 32, 4 experts of 16.
SMALLER = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
               moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4, num_local_experts=4,
               n_routed_experts=4, num_experts_per_tok=2)
# The families with a router aux loss (registry), which the cases run with it on.
AUX = dict(output_router_logits=True, router_aux_loss_coef=0.5)
ROUTER = {"gpt_oss": "router"}  # the router module's name under `mlp` (others: "gate")
# Beyond `SMALLER`: Qwen3.5's two layers one of each attention (its default has three linear ones to one full).
FAMILY_SETTINGS = {"qwen3_5_moe_text": {"layer_types": ["linear_attention", "full_attention"]},
                   "granitemoehybrid": {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 8}}
NUM_MB = 2
STEPS = 2
LR = 1e-2

# (model_type, how PEFT reaches the experts, aux loss): every MoE family docs/models.md names.
CASES = [
    ("qwen3_moe", "target_modules", True),
    ("qwen3_moe", "target_parameters", True),
    ("olmoe", "target_modules", True),
    ("deepseek_v3", "target_modules", False),
    ("gpt_oss", "target_parameters", True),
    ("mixtral", "target_parameters", True),
    ("qwen2_moe", "target_parameters", True),
    ("qwen3_5_moe_text", "target_parameters", True),
]


def _case_id(case) -> str:
    return f"{case[0]}-{case[1]}"


def tiny_moe(model_type: str, aux: bool) -> nn.Module:
    """A 2-layer float64 model of `model_type` (hidden 32, 4 experts), zero/one-initialised parameters made random."""
    config_class = transformers.CONFIG_MAPPING[model_type]
    names = {field.name for field in dataclasses.fields(config_class)} if dataclasses.is_dataclass(config_class) \
        else set()
    names |= set(getattr(config_class, "attribute_map", {}))
    settings = {**SHRINK, **SMALLER, **OVERRIDES.get(model_type, {}),
                **FAMILY_SETTINGS.get(model_type, {}), **(AUX if aux else {})}
    if "q_lora_rank" in settings:  # multi-head latent attention: as many key/value heads as query heads
        settings["num_key_value_heads"] = settings["num_attention_heads"]
    config = config_class(**{key: value for key, value in settings.items() if key in names}, use_cache=False)
    model_class = transformers.MODEL_FOR_CAUSAL_LM_MAPPING[config_class]
    # sdpa where the family has it: eager attention gives NaN in HF itself for the fully masked query rows of a
    # left-padded float64 batch (`EAGER_ONLY` families run right-padded batches); GPT-OSS needs eager for its
    # attention sinks, which keep those rows finite.
    sdpa = model_class._supports_sdpa and model_type != "gpt_oss"
    config._attn_implementation = "sdpa" if sdpa else "eager"
    config._experts_implementation = "eager"  # grouped_mm has no float64 kernel
    torch.manual_seed(0)
    model = model_class(config).to(torch.float64)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.numel() == 1 or parameter.std() == 0:
                parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))
    return model.train()


def lora_config(model_type: str, way: str):
    router = [ROUTER.get(model_type, "gate")]
    if way == "target_modules":
        return peft.LoraConfig(r=2, lora_alpha=4, target_modules=USUAL_TARGETS, modules_to_save=router)
    return peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "o_proj"], modules_to_save=router,
                           target_parameters=EXPERT_PARAMETERS)


def lora_on_experts(model_type: str, way: str, aux: bool) -> nn.Module:
    """PEFT LoRA over the tiny model, its LoRA B random (PEFT starts it at zero: A's gradient would be zero)."""
    model = peft.get_peft_model(tiny_moe(model_type, aux), lora_config(model_type, way))
    wrapped = {name.split(".base_layer")[0].split("layers.")[-1] for name, module in model.named_modules()
               if type(module).__name__ == "ParamWrapper"}
    assert wrapped == {"0.mlp.experts", "1.mlp.experts"} or (model_type == "deepseek_v3" and wrapped == {
        "1.mlp.experts"}), f"PEFT did not put LoRA on the experts: {wrapped}"  # DeepSeek-V3: layer 0 is dense
    randomize_lora_b(model)
    return model


def randomize_lora_b(model: nn.Module) -> None:
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(0.1 * torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))


def micro_batched_loss(model: nn.Module, batch: dict[str, torch.Tensor], num_mb: int) -> torch.Tensor:
    """The loss the engine defines, from plain PEFT/HF one micro-batch at a time (float64): the language-model
    part over the whole batch's label count, plus each micro-batch's Switch aux loss times its share of the
    batch's tokens ([Note: router statistics])."""
    shifted = nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=-100)
    labels_total = (shifted != -100).sum()
    tokens_total = batch["attention_mask"].sum()
    router = getattr(model.config, "output_router_logits", False)
    total = 0
    rows = [torch.tensor_split(t, num_mb) for t in (batch["input_ids"], batch["attention_mask"], shifted)]
    for input_ids, mask, labels in zip(*rows):
        outputs = model(input_ids=input_ids, attention_mask=mask, output_router_logits=router)
        total = total + nn.functional.cross_entropy(
            outputs.logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100, reduction="sum") / labels_total
        if router:
            aux = switch_aux_loss(outputs.router_logits, model.config.num_experts if hasattr(
                model.config, "num_experts") else model.config.num_local_experts,
                model.config.num_experts_per_tok, mask)
            total = total + model.config.router_aux_loss_coef * aux * mask.sum() / tokens_total
    return total


def trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def train_both(model: nn.Module, devices: int = 2) -> tuple[nn.Module, list, list]:
    """`STEPS` AdamW steps on the engine and on a plain copy; returns the plain copy and the per-step losses and
    first-step gradients of both ((engine, plain) pairs). Closes the engine."""
    ref = copy.deepcopy(model)
    engine = wrap_model(model, RoundPipeConfig(devices=["cpu"] * devices, num_microbatches=NUM_MB,
                                               async_optimizer=False))
    optimizer = engine.wrap_optimizer(torch.optim.AdamW(list(trainable(engine).values()), lr=LR))
    ref_optimizer = torch.optim.AdamW(list(trainable(ref).values()), lr=LR)
    losses, grads = [], []
    try:
        for step in range(STEPS):
            batch = make_batch("left" if step % 2 == 0 else "mixed", seed=step)
            loss = engine.forward_backward(**batch)
            expected = micro_batched_loss(ref, batch, NUM_MB)
            expected.backward()
            losses.append((loss, expected.detach()))
            if step == 0:
                engine.synchronize()
                grads = [({n: p.grad.clone() for n, p in trainable(engine).items()},
                          {n: p.grad.clone() for n, p in trainable(ref).items()})]
            optimizer.step()
            optimizer.zero_grad()
            ref_optimizer.step()
            ref_optimizer.zero_grad()
        engine.synchronize()
    finally:
        engine.close()
    return ref, losses, grads


def assert_same_tensors(actual: dict, expected: dict, what: str, rtol: float = 1e-10) -> None:
    """Each tensor at the scale of its own largest element, or of a millionth of the largest of all when its own
    is far smaller (a gradient zero but for rounding)."""
    assert actual.keys() == expected.keys(), f"{what}: different names {sorted(actual.keys() ^ expected.keys())}"
    largest = max(float(t.detach().abs().max()) for t in expected.values())
    for name, tensor in expected.items():
        scale = max(float(tensor.detach().abs().max()), 1e-6 * largest)
        error = float((actual[name].detach() - tensor.detach()).abs().max()) / scale
        assert error <= rtol, f"{what} {name}: relative error {error:.3e}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_lora_on_experts_trains_merges_and_saves_as_plain_peft(case, tmp_path):
    model_type, way, aux = case
    if model_type not in transformers.CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {model_type}")
    model = lora_on_experts(model_type, way, aux)
    ref, losses, grads = train_both(model)

    for step, (loss, expected) in enumerate(losses):
        assert_close(loss, expected, f"loss of step {step}")
    engine_grads, plain_grads = grads[0]
    expert_adapters = [n for n in plain_grads if "experts" in n and "lora_" in n]
    routers = [n for n in plain_grads if "modules_to_save" in n]
    assert expert_adapters and routers and all(plain_grads[n].abs().max() > 0 for n in expert_adapters + routers)
    assert_same_tensors(engine_grads, plain_grads, "first step's gradient of")
    assert_same_tensors(trainable(model), trainable(ref), f"after {STEPS} steps,")

    model.save_pretrained(tmp_path / "engine")
    ref.save_pretrained(tmp_path / "plain")
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "engine" / "adapter_model.safetensors")
    assert any("experts" in name for name in saved)
    assert_same_tensors(saved, load_file(tmp_path / "plain" / "adapter_model.safetensors"), "saved adapter")
    # PEFT writes `target_modules` and `target_parameters` from sets: their order is not kept between two models
    # (it follows the hash seed), so they are compared as sets.
    configs = [{key: sorted(value) if key in ("target_modules", "target_parameters") and value else value
                for key, value in json.loads((tmp_path / which / "adapter_config.json").read_text()).items()}
               for which in ("engine", "plain")]
    assert configs[0] == configs[1]

    batch = make_batch("right", seed=5)
    unlabeled = {k: v for k, v in batch.items() if k != "labels"}
    model.eval()
    with torch.no_grad():
        trained_logits = model(**unlabeled).logits
    merged, ref_merged = model.merge_and_unload(), ref.merge_and_unload()
    assert not any(type(m).__name__ == "ParamWrapper" for m in merged.modules())
    assert_same_tensors(merged.state_dict(), ref_merged.state_dict(), "merged")
    with torch.no_grad():
        assert_close(merged.eval()(**unlabeled).logits, trained_logits, "merged model's logits vs the trained one's")


# The other families of the catalog (docs/models.md's table) whose experts hold fused 3-D parameters, found by
# scanning decoder_catalog's supported tiny models for them: those PEFT reaches through the usual `target_modules`
# names, and the rest, reached through `target_parameters`.
OTHER_BY_MODULE_NAMES = ("afmoe", "cohere2_moe", "deepseek_v2", "ernie4_5_moe", "exaone_moe", "flex_olmo", "glm4_moe",
                         "glm4_moe_lite", "hunyuan_v1_moe", "mellum", "qwen3_next", "sarvam_mla", "solar_open")
OTHER_BY_PARAMETERS = ("aria_text", "granitemoe", "granitemoe_swa", "granitemoehybrid", "granitemoeshared", "hy_v3",
                       "jamba", "jetmoe", "kimi_linear", "kolibri1", "laguna", "lara_mini", "llama4_text",
                       "mimo_v2_flash", "minimax", "minimax_m2", "minimax_m3_vl_text", "nemotron_h", "phimoe",
                       "sarvam_moe")


def expert_parameters(model: nn.Module) -> list[str]:
    """The 3-D parameters of experts, named as `target_parameters` takes them (below the decoder layer)."""
    return sorted({name.split("layers.", 1)[1].split(".", 1)[1] for name, p in model.named_parameters()
                   if p.ndim == 3 and ".experts." in name})


@pytest.mark.parametrize("model_type", [*OTHER_BY_MODULE_NAMES, *OTHER_BY_PARAMETERS])
def test_every_other_moe_family_with_lora_on_its_experts(model_type):
    """One pass on two CPU workers with two micro-batches: the loss and every adapter's gradient are plain PEFT's.
    Where HF's head rounds a float64 model's logits to float32 (Nemotron-H), its loss carries that rounding and the
    comparison is at float32 precision (docs/models.md)."""
    if model_type not in transformers.CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {model_type}")
    base = tiny_moe(model_type, aux=False)
    if model_type in OTHER_BY_MODULE_NAMES:
        config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=USUAL_TARGETS)
    else:
        config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=[], target_parameters=expert_parameters(base))
    model = peft.get_peft_model(base, config)
    assert any(type(m).__name__ == "ParamWrapper" for m in model.modules()), "no LoRA on the experts"
    randomize_lora_b(model)
    ref = copy.deepcopy(model)
    batch = make_batch("right")
    expected = micro_batched_loss(ref, batch, NUM_MB)
    expected.backward()
    rtol = 1e-10 if ref(input_ids=batch["input_ids"]).logits.dtype == torch.float64 else 1e-6
    engine = wrap_model(model, RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=NUM_MB))
    try:
        loss = engine.forward_backward(**batch)
        engine.synchronize()
        actual = {name: p.grad.clone() for name, p in trainable(engine).items()}
    finally:
        engine.close()
    assert_close(loss, expected.detach(), "loss", rtol)
    grads = {name: p.grad for name, p in trainable(ref).items()}
    assert any("experts" in name and grad.abs().max() > 0 for name, grad in grads.items())
    assert_same_tensors(actual, grads, "gradient of", rtol)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_full_fine_tuning_of_the_same_models_stays_exact(model_type):
    """No PEFT: every weight (routers and experts included) after AdamW steps, with the aux loss and two
    micro-batches."""
    model = tiny_moe(model_type, aux=True)
    ref, losses, grads = train_both(model)
    for step, (loss, expected) in enumerate(losses):
        assert_close(loss, expected, f"loss of step {step}")
    assert_same_tensors(*grads[0], "first step's gradient of")
    assert_same_tensors(trainable(model), trainable(ref), f"after {STEPS} steps,")


def test_the_users_lora_wrappers_keep_peft_forward():
    """The engine's own forward for PEFT's wrappers is on its layer copies only: the user's model, run on its own
    after the engine is closed, is PEFT's (its logits equal a plain copy's)."""
    model = lora_on_experts("qwen3_moe", "target_modules", aux=False)
    ref = copy.deepcopy(model)
    engine = wrap_model(model, RoundPipeConfig(devices=["cpu"], num_microbatches=1))
    engine.forward_backward(**make_batch("left"))
    engine.close()
    wrappers = [m for m in model.modules() if type(m).__name__ == "ParamWrapper"]
    assert wrappers and all("forward" not in vars(m) for m in wrappers)
    batch = {k: v for k, v in make_batch("right").items() if k != "labels"}
    with torch.no_grad():
        assert_close(model(**batch).logits, ref(**batch).logits, "the user's model after the engine")


def test_two_workers_run_one_layer_with_lora_on_its_experts_at_once():
    """[Note: LoRA on parameters in layer copies]: two device copies of one decoder layer, each bound to its own
    tensors, run forward and backward in two threads at the same time, over and over: each gives plain PEFT's
    output and gradients every time, neither changes its state ([Note: stateless layers]) and the user's layer is
    left as it was (no parametrization, its own parameters)."""
    import threading

    from accelerate_roundpipe.models import split_causal_lm
    from accelerate_roundpipe.runtime.execution.layer_copy import LayerCopy
    from accelerate_roundpipe.runtime.state.host_store import Binding

    model = lora_on_experts("qwen3_moe", "target_modules", aux=False)
    split = split_causal_lm(model)
    layer = split.layers[2]  # decoder layer 1
    own = {name: p for name, p in layer.named_parameters(remove_duplicate=False)}
    bindings = [Binding(name.rpartition(".")[0], name.rpartition(".")[2], 0, index)
                for index, name in enumerate(own)]
    with torch.no_grad():
        inputs = split.layers[1](*split.layers[0](*split.prepare_inputs(**make_batch("left"))))
    hidden = inputs[0].detach().requires_grad_(True)
    out_weights = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(4), dtype=hidden.dtype)
    (layer(hidden, *inputs[1:])[0] * out_weights).sum().backward()
    expected_out = layer(hidden, *inputs[1:])[0].detach()
    expected = {name: p.grad.clone() for name, p in own.items() if p.grad is not None}
    expected_input = hidden.grad.clone()
    assert any("experts" in name for name in expected)

    copies = [LayerCopy(layer, 2, bindings, torch.device("cpu")) for _ in range(2)]
    start = threading.Barrier(2)
    failures = []

    def run(copy_: LayerCopy) -> None:
        try:
            tensors = {b: own[f"{b.module_path}.{b.attr}"].detach().clone().requires_grad_(
                own[f"{b.module_path}.{b.attr}"].requires_grad) for b in bindings}
            copy_.bind(tensors.__getitem__)
            copy_.set_training(True)
            for _ in range(20):
                start.wait()
                x = hidden.detach().requires_grad_(True)
                before = copy_.state()
                out = copy_.module(x, *inputs[1:])[0]
                copy_.check_stateless(before)
                (out * out_weights).sum().backward()
                assert_close(out.detach(), expected_out, "output")
                assert_close(x.grad, expected_input, "input gradient")
                for binding, tensor in tensors.items():
                    name = f"{binding.module_path}.{binding.attr}"
                    if name in expected:
                        assert_close(tensor.grad, expected[name], f"gradient of {name}")
                        tensor.grad = None
        except BaseException as error:  # noqa: BLE001 (reported by the main thread)
            failures.append(error)
            start.abort()

    threads = [threading.Thread(target=run, args=(c,)) for c in copies]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures[0]
    assert not any(hasattr(m, "parametrizations") for m in layer.modules())
    assert all(p is own[name] for name, p in layer.named_parameters(remove_duplicate=False))


def test_liger_kernels_leave_the_lora_wrapped_experts_to_the_model(monkeypatch):
    """On GPUs the engine applies Liger-Kernel (`kernels="auto"`), whose instance patch binds its fused experts'
    forward to `mlp.experts`: under PEFT that is the LoRA wrapper, where it failed (`'ParamWrapper' object has no
    attribute 'hidden_dim'`) and would have run without the adapters. The wrappers get PEFT's forward back; every
    other module keeps Liger's patch. Liger is faked here (a CPU machine has neither it nor a GPU): its patch as
    `liger_kernel.transformers.monkey_patch._patch_swiglu_module` makes it, a forward and a name bound on the
    instance."""
    import importlib.machinery
    import sys
    import types

    from accelerate_roundpipe.models.kernels import apply_fused_kernels

    def liger_experts_forward(self, hidden_states, top_k_index, top_k_weights):
        return hidden_states.view(-1, self.hidden_dim)  # what Liger's fused experts read first

    def liger_norm_forward(self, hidden_states):
        return hidden_states

    def apply_to_instance(model, **kwargs):
        for layer in model.model.layers:
            for module, forward in ((layer.mlp.experts, liger_experts_forward),
                                    (layer.input_layernorm, liger_norm_forward)):
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

    model = lora_on_experts("qwen3_moe", "target_modules", aux=False)
    ref = copy.deepcopy(model)
    assert apply_fused_kernels(model, "auto", [torch.device("cuda", 0)])
    layers = model.base_model.model.model.layers
    assert all("forward" in vars(layer.input_layernorm) for layer in layers)  # Liger's patch elsewhere stays
    for layer in layers:  # the fake's identity norm would change the logits: the norms are left to the model
        del layer.input_layernorm.forward, layer.input_layernorm._get_name
    batch = make_batch("left")
    engine = wrap_model(model, RoundPipeConfig(devices=["cpu"], num_microbatches=1))
    try:
        loss = engine.forward_backward(**batch)
    finally:
        engine.close()
    assert_close(loss, micro_batched_loss(ref, batch, 1).detach(), "loss after the Liger patch")
    assert all(not {"forward", "_get_name"} & set(vars(layer.mlp.experts)) for layer in layers)


def test_a_changed_peft_wrapper_is_refused_with_the_version_to_pin(monkeypatch):
    """[Note: compatibility reaches]: a PEFT whose `ParamWrapper` no longer applies LoRA by the forward-time
    parametrization the layer copies reproduce is refused by name, not run with another computation."""
    from peft.tuners.lora.layer import ParamWrapper

    from accelerate_roundpipe.compat import LibraryChangedError
    from accelerate_roundpipe.compat.peft_internals import check_param_wrapper, make_param_wrappers_stateless

    check_param_wrapper()  # the installed PEFT passes
    model = lora_on_experts("qwen3_moe", "target_modules", aux=False)

    def activate_otherwise(self, active_adapters):  # e.g. a later PEFT computing the delta another way
        yield

    monkeypatch.setattr(ParamWrapper, "_activate_lora", activate_otherwise)
    with pytest.raises(LibraryChangedError, match=r"peft .*ParamWrapper.*no longer looks up `get_delta_factors`"):
        make_param_wrappers_stateless(copy.deepcopy(model))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kernels", ["none", "auto"])
@pytest.mark.parametrize(("model_type", "way"), [("qwen3_moe", "target_modules"), ("gpt_oss", "target_parameters")])
def test_lora_on_experts_on_cuda(model_type, way, kernels):
    """On a GPU (float32, no TF32), with and without Liger's kernels: the loss and the adapters' and router's
    gradients of two micro-batches are plain PEFT's on the GPU."""
    from accelerate_roundpipe.models.kernels import liger_available

    if kernels == "auto" and not liger_available():
        pytest.skip("Liger-Kernel is not installed")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = lora_on_experts(model_type, way, aux=True).float()
    ref = copy.deepcopy(model).cuda()
    batch = make_batch("left")
    expected = micro_batched_loss(ref, {k: v.cuda() for k, v in batch.items()}, NUM_MB)
    expected.backward()
    engine = wrap_model(model, RoundPipeConfig(devices=["cuda:0"], num_microbatches=NUM_MB, kernels=kernels))
    try:
        assert engine.fused_kernels == (kernels == "auto")
        loss = engine.forward_backward(**batch)
        engine.synchronize()
        grads = {name: p.grad.clone() for name, p in trainable(engine).items()}
    finally:
        engine.close()
    assert_close(loss, expected.detach().cpu(), "loss", rtol=1e-5)
    assert_same_tensors(grads, {name: p.grad.cpu() for name, p in trainable(ref).items()}, "gradient of", rtol=2e-4)
