"""Fused GPU kernels for the decoder layers: Liger-Kernel's RMSNorm, SwiGLU and RoPE, when installed.

HF training with these kernels runs about 1.5x faster than plain HF on an H200 (the anchors of the GPU speed issue),
mostly from fewer, larger kernels and less activation memory traffic. They are Triton kernels, so they are applied
only when every engine device is a GPU. Liger patches the model *instance* (its norms and MLPs, which the engine's
layer copies inherit) and, for RoPE, the family's module-level `apply_rotary_pos_emb` (as HF's own
`use_liger_kernel` does: other models of that family in the process get the same kernel). The loss head is ours
(`fused_ce.py`); Liger's fused linear cross-entropy is not used because it replaces the model's forward.

Liger's instance patch also replaces the forward of MoE experts (`LigerExperts`, a Triton fused MoE, for Qwen3-MoE,
Mixtral, Qwen3-Next, Qwen3.5-MoE, DeepSeek-V2/V3, HunYuan-MoE, ...). That is left out: the experts keep the forward
transformers gave them, which runs the implementation the model's config names ("grouped_mm", torch's grouped GEMM,
by default; see [Note: experts implementation of layer copies] in `layers.py`), so every way of training a model
(full, LoRA, CPU workers) runs what its config says, and no process pays the autotuning of Liger's experts at their
first call (Triton benchmarks each of its kernels in 16 to 40 configurations; Liger-Kernel 0.8.5).
`benchmarks/moe_experts.py --liger` times Liger's experts beside grouped_mm. They stay one `experts_implementation`
away for whoever wants them: register their forward with transformers
(`ALL_EXPERTS_FUNCTIONS.register("liger", LigerExperts.forward)`) and choose it
(`model.set_experts_implementation("liger")`); the layer copies follow the model's choice.
"""

from __future__ import annotations

import importlib.util
import logging

import torch
from torch import nn

from ..compat.hf_experts import dispatching_experts
from ..compat.peft_internals import param_wrappers

logger = logging.getLogger(__name__)


def liger_available() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def _transformers_model(model: nn.Module) -> nn.Module:
    get_base = getattr(model, "get_base_model", None)  # peft.PeftModel
    return get_base() if callable(get_base) else model


def apply_fused_kernels(model: nn.Module, kernels: str, devices: list[torch.device]) -> bool:
    """Patch `model` with Liger kernels as `kernels` asks ("auto": when installed and every device is CUDA;
    "liger": required; "none": never). Returns whether kernels were applied."""
    if kernels == "none":
        return False
    all_cuda = bool(devices) and all(d.type == "cuda" for d in devices)
    if kernels == "liger" and not liger_available():
        raise ImportError("kernels='liger' (env ROUNDPIPE_KERNELS) needs Liger-Kernel: `pip install liger-kernel`, or "
                          "set kernels='auto' / 'none'.")
    if kernels == "liger" and not all_cuda:
        raise ValueError(f"kernels='liger' needs every device to be a CUDA GPU (Triton kernels); devices are "
                         f"{[str(d) for d in devices]}. Set kernels='none' for CPU workers.")
    if not (all_cuda and liger_available()):
        return False
    from liger_kernel.transformers import _apply_liger_kernel_to_instance
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    target = _transformers_model(model)
    model_type = getattr(getattr(target, "config", None), "model_type", None)
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        if kernels == "liger":
            raise ValueError(f"Liger-Kernel has no kernels for model type {model_type!r}; set kernels='auto' or "
                             f"'none'.")
        logger.info("Liger-Kernel has no kernels for model type %r; running the model's own layers.", model_type)
        return False
    wrappers = [module for _, module in param_wrappers(target)]
    experts = [module for _, module in dispatching_experts(target)]
    kept_out = wrappers + experts
    held = [{name: vars(module).get(name) for name in _LIGER_SET} for module in kept_out]
    _apply_liger_kernel_to_instance(model=target, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False)
    undone = _undo_liger(kept_out, held)
    if undone:
        logger.info("Liger-Kernel's fused experts left out of %d modules: the experts run the model's "
                    "experts_implementation (%r), with the adapters PEFT puts on them.", undone,
                    getattr(target.config, "_experts_implementation", None))
    logger.info("Applied Liger-Kernel RMSNorm, SwiGLU and RoPE to the %s model.", model_type)
    return True


# What Liger's instance patch of a module sets on it (its `_patch_swiglu_module`).
_LIGER_SET = ("forward", "_get_name")


def _undo_liger(modules: list[nn.Module], held: list[dict]) -> int:
    """Give `modules` back what they held before Liger patched them: the experts modules that dispatch on the
    config's experts_implementation (see the module docstring) and PEFT's LoRA wrappers of parameters (MoE experts'
    `mlp.experts` under LoRA: Liger's experts forward, bound to the wrapper, reads the experts' attributes
    (`hidden_dim`, the weights) from it and fails, and would run without the adapters if it did not). Returns how
    many it undid."""
    undone = 0
    for module, before in zip(modules, held):
        if all(vars(module).get(name) is value for name, value in before.items()):
            continue
        undone += 1
        for name, value in before.items():
            if value is None:
                module.__dict__.pop(name, None)
            else:
                module.__dict__[name] = value
    return undone
