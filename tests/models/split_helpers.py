"""Tiny random HF causal LMs (float64) and reference computations for the tests of `accelerate_roundpipe.models`."""

from __future__ import annotations

import copy

import torch
import transformers
from torch import nn

VOCAB = 128
BATCH, SEQ = 3, 12
COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    attention_dropout=0.0,
    tie_word_embeddings=False,
)

# family -> (config class, model class, config overrides, attention implementation)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, "sdpa"),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 5}, "sdpa"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}, "sdpa"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}, "sdpa"),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {
            "head_dim": 16,
            "sliding_window": 5,
            "final_logit_softcapping": 3.0,
            "attn_logit_softcapping": 5.0,
            "query_pre_attn_scalar": 16,
        },
        "eager",
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "head_dim": 16,
            "sliding_window": 5,
            "layer_types": ["sliding_attention", "full_attention"],
            "final_logit_softcapping": 3.0,
            "query_pre_attn_scalar": 16,
        },
        "sdpa",
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}, "sdpa"),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "output_router_logits": True,
            "router_aux_loss_coef": 0.5,
        },
        "sdpa",
    ),
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        {
            "head_dim": 16,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 5,
            "layer_types": ["sliding_attention", "full_attention"],
            "output_router_logits": True,
            "router_aux_loss_coef": 0.5,
        },
        "eager",
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "output_router_logits": True, "router_aux_loss_coef": 0.5},
        "sdpa",
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
            "output_router_logits": True,
            "router_aux_loss_coef": 0.5,
        },
        "sdpa",
    ),
    "olmoe": (
        "OlmoeConfig",
        "OlmoeForCausalLM",
        {"num_experts": 4, "num_experts_per_tok": 2, "output_router_logits": True, "router_aux_loss_coef": 0.5},
        "sdpa",
    ),
}

MOE_FAMILIES = {"qwen3_moe", "gpt_oss", "mixtral", "qwen2_moe", "olmoe"}
FLOAT32_NORM_FAMILIES = {"gemma2", "gemma3"}


def available_families() -> list[str]:
    return [name for name, (config_name, *_rest) in FAMILIES.items() if hasattr(transformers, config_name)]


def build_model(family: str, **overrides) -> nn.Module:
    """A tiny random float64 model of `family` in training mode with no dropout."""
    config_name, model_name, family_overrides, attention = FAMILIES[family]
    config = getattr(transformers, config_name)(**{**COMMON, **family_overrides, **overrides})
    config._attn_implementation = attention
    if hasattr(config, "_experts_implementation"):  # transformers 5: grouped_mm has no float64 kernel
        config._experts_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).to(torch.float64)
    _randomize_zero_initialised(model)
    return model.train()


def lora_model(family: str, targets: tuple[str, ...] | list[str], **overrides) -> nn.Module:
    """A PEFT LoRA model (r=4, no dropout) over a tiny float64 base of `family`. PEFT starts LoRA B at zero, so B is
    made random here (with B = 0 the gradient of A would be zero and the check of A's gradients empty)."""
    import peft

    model = peft.get_peft_model(
        build_model(family, **overrides),
        peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(targets)),
    )
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(0.1 * torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))
    return model


def _randomize_zero_initialised(model: nn.Module) -> None:
    """Some parameters start at zero or one (norm offsets, routers, sinks); make them random so tests see them."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            constant = parameter.numel() == 1 or parameter.std() == 0
            if constant:
                parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))


def make_batch(padding: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """input_ids, attention_mask and labels; `padding` is "left", "right", "mixed" or "none"."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=generator)
    attention_mask = torch.ones(BATCH, SEQ, dtype=torch.int64)
    if padding in ("left", "mixed"):
        attention_mask[0, :3] = 0
        attention_mask[2, :1] = 0
    if padding == "left":
        attention_mask[1, :5] = 0
    if padding in ("right", "mixed"):
        attention_mask[1, -4:] = 0
    if padding == "right":
        attention_mask[0, -2:] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[2, 6] = -100
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    if padding == "none":
        del batch["attention_mask"]
    return batch


def run_layers(layers: nn.Sequential, inputs: tuple[torch.Tensor, ...]):
    """What the engine does for one micro-batch: feed each layer the previous layer's tensors."""
    value = inputs
    for layer in layers:
        value = layer(*value) if isinstance(value, tuple) else layer(value)
    return value


def split_rows(inputs: tuple[torch.Tensor, ...], sizes: list[int]) -> list[tuple[torch.Tensor, ...]]:
    """Micro-batches: every input tensor split along dim 0."""
    pieces = [torch.split(tensor, sizes, dim=0) for tensor in inputs]
    return [tuple(piece[index] for piece in pieces) for index in range(len(sizes))]


def cuda_reference(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """HF's loss and gradients for a copy of `model` on the GPU (float32 matmuls without TF32): the CUDA tests'
    reference."""
    torch.backends.cuda.matmul.allow_tf32 = False
    reference = copy.deepcopy(model).cuda()
    loss = reference_loss(reference, {k: v.cuda() for k, v in batch.items()})
    loss.backward()
    return loss.detach().cpu(), {n: p.grad.cpu() for n, p in reference.named_parameters()}


def reference_loss(model: nn.Module, batch: dict[str, torch.Tensor], **model_kwargs) -> torch.Tensor:
    """HF's loss recomputed in float64 from HF's own logits and router logits (HF upcasts only to float32)."""
    labels = batch["labels"]
    inputs = {k: v for k, v in batch.items() if k != "labels"} | model_kwargs
    router = getattr(model.config, "output_router_logits", False)
    outputs = model(**inputs, output_router_logits=True) if router else model(**inputs)
    shift_labels = nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    loss = (
        nn.functional.cross_entropy(
            outputs.logits.reshape(-1, VOCAB), shift_labels.reshape(-1), ignore_index=-100, reduction="sum"
        )
        / (shift_labels != -100).sum()
    )
    if router:
        mask = batch.get("attention_mask")
        aux = switch_aux_loss(outputs.router_logits, model.num_experts, model.num_experts_per_tok, mask)
        loss = loss + model.router_aux_loss_coef * aux
    return loss


def switch_aux_loss(router_logits, num_experts: int, top_k: int, attention_mask) -> torch.Tensor:
    """HF's `load_balancing_loss_func` (4.57 form, all layers concatenated), kept in the logits' dtype."""
    logits = torch.cat(list(router_logits), dim=0)
    weights = torch.softmax(logits, dim=-1)
    picks = nn.functional.one_hot(torch.topk(weights, top_k, dim=-1).indices, num_experts).sum(dim=1)
    if attention_mask is None:
        token_mask = torch.ones(logits.shape[0], dtype=logits.dtype)
    else:
        token_mask = attention_mask.reshape(-1).repeat(len(router_logits)).to(logits.dtype)
    rows = token_mask.sum()
    picks_per_expert = (picks * token_mask[:, None]).sum(dim=0) / rows
    prob_per_expert = (weights * token_mask[:, None]).sum(dim=0) / rows
    return num_experts * torch.sum(picks_per_expert * prob_per_expert)


def gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str, rtol: float = 1e-10) -> None:
    scale = expected.abs().max().clamp_min(1e-300)
    error = (actual - expected).abs().max() / scale
    assert error <= rtol, f"{what}: relative error {error.item():.3e} > {rtol:g}"


def assert_same_gradients(actual: dict, expected: dict, rtol: float = 1e-10, float32_norms: bool = False) -> None:
    """`float32_norms`: the family's RMSNorm computes in float32 even in a float64 model (Gemma), so the gradients of
    norm weights carry float32 rounding that depends on how rows are grouped; they get a float32 tolerance."""
    assert actual.keys() == expected.keys(), f"gradients on different parameters: {actual.keys() ^ expected.keys()}"
    for name in expected:
        tolerance = 1e-6 if float32_norms and "norm" in name.rsplit(".", 2)[-2] else rtol
        assert_close(actual[name], expected[name], f"grad of {name}", tolerance)
