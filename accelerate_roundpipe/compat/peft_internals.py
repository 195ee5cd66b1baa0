"""The reaches into PEFT's LoRA layers ([Note: compatibility reaches]). Written against peft 0.21 and torch 2.13.
Caller: `runtime/execution/layer_copy.py` (each device's copy of a layer).

[Note: LoRA on parameters in layer copies]
PEFT puts LoRA on a bare parameter (MoE experts' fused 3-D `gate_up_proj` / `down_proj`, reached through
`target_parameters` or through `target_modules` names on transformers 5) with a `ParamWrapper` around the module
holding it. Its forward (`_activate_lora`) registers a `torch.nn.utils.parametrize` parametrization on that module
for the call (the parameter becomes `W + scaling * B @ A`) and removes it afterwards, under `parametrize.cached()`.
On an engine's layer copy that cannot work: the copy binds plain tensor views of its uploads in place of the
parameters ([Note: stateless layers]), which parametrize keeps as a *buffer* `original` and puts back as a buffer;
its cache switch and cache are process-global, so one worker's forward leaves caching on (and its cached weights,
whose graph is another micro-batch's) for another worker running the same layer at once. So each device's copy gets
a forward of its own for every `ParamWrapper` in it (`make_param_wrappers_stateless`): it computes the parameter
PEFT would (`lora_parameter`: PEFT's own factors, proxies and choice between them, so the same operations in the
same order) and binds it into the copy's module for the call only, then binds the upload back. Nothing shared is
touched and nothing outlives the call. The user's model keeps PEFT's forward, so merging and saving are PEFT's own.
"""

from __future__ import annotations

import sys
from types import MethodType

import torch
from torch import nn

from . import peft_experts, require_attribute, require_mention

LIBRARY = "peft"
LAYER_MODULE = "peft.tuners.lora.layer"
REACH = "peft.tuners.lora.layer.ParamWrapper (LoRA on a parameter, run by each device's layer copy)"
# What ParamWrapper's forward-time parametrization reads, which `lora_parameter` reproduces.
_ACTIVATE_LOOKUPS = ("get_delta_factors", "get_delta_weight", "_LoraFactorsProxy", "_LoraParameterProxy",
                     "UPCAST_DTYPES", "register_parametrization", "num_experts", "lora_A")
_FORWARD_LOOKUPS = ("_activate_lora", "disable_adapters", "merged", "base_layer", "_check_forward_args",
                    "active_adapters")


def param_wrapper_class() -> type | None:
    """PEFT's `ParamWrapper`, or None when PEFT's LoRA layers were never imported (then no model holds one)."""
    layer = sys.modules.get(LAYER_MODULE)
    return None if layer is None else getattr(layer, "ParamWrapper", None)


def param_wrappers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The PEFT `ParamWrapper`s in `module`, with their paths (none when PEFT's LoRA layers were never imported)."""
    wrapper_class = param_wrapper_class()
    if wrapper_class is None:
        return []
    return [(path, m) for path, m in module.named_modules(remove_duplicate=False) if isinstance(m, wrapper_class)]


def check_param_wrapper() -> None:
    """PEFT's `ParamWrapper` still applies LoRA by the forward-time parametrization `lora_parameter` reproduces."""
    layer = sys.modules[LAYER_MODULE]
    wrapper = require_attribute(layer, "ParamWrapper", LIBRARY, REACH)
    for name in ("_LoraFactorsProxy", "_LoraParameterProxy", "UPCAST_DTYPES"):
        require_attribute(layer, name, LIBRARY, REACH)
    for name in ("_activate_lora", "get_delta_factors", "get_delta_weight", "get_base_layer", "forward"):
        require_attribute(wrapper, name, LIBRARY, REACH)
    for name in _FORWARD_LOOKUPS:
        require_mention(wrapper.forward, name, LIBRARY, REACH)
    for name in _ACTIVATE_LOOKUPS:
        require_mention(wrapper._activate_lora, name, LIBRARY, REACH)


def _active_adapters(wrapper: nn.Module) -> list[str]:
    return [a for a in wrapper.active_adapters if a in wrapper.lora_A]


def folded_factors(wrapper: nn.Module, param: torch.Tensor) -> tuple | None:
    """(lhs, rhs, scaling) where `ParamWrapper._activate_lora` (peft 0.21) folds one adapter's factors into `param`
    (`_LoraFactorsProxy`: one active adapter on stacked experts in a dtype it does not upcast), else None."""
    layer = sys.modules[LAYER_MODULE]
    adapters = _active_adapters(wrapper)
    low_precision = any(getattr(torch, name, None) == param.dtype for name in layer.UPCAST_DTYPES)
    if len(adapters) == 1 and wrapper.num_experts > 1 and not low_precision:
        return wrapper.get_delta_factors(adapters[0])
    return None


def lora_parameter(wrapper: nn.Module, param: torch.Tensor) -> torch.Tensor | None:
    """The parameter `wrapper` (a `ParamWrapper`) makes of `param` for its forward, as `ParamWrapper._activate_lora`
    computes it (peft 0.21): one adapter on stacked experts folds its factors into `param` with one `baddbmm`
    (`_LoraFactorsProxy`); several adapters, one 2-D parameter or a low-precision dtype add the summed delta weights
    (`_LoraParameterProxy`). None when no active adapter is on it (the parameter is used as it is)."""
    layer = sys.modules[LAYER_MODULE]
    adapters = _active_adapters(wrapper)
    if not adapters:
        return None
    factors = folded_factors(wrapper, param)
    if factors is not None:
        return layer._LoraFactorsProxy(*factors)(param)
    delta = None
    for adapter in adapters:
        delta = wrapper.get_delta_weight(adapter) if delta is None else delta + wrapper.get_delta_weight(adapter)
    return layer._LoraParameterProxy(delta)(param)


def chain_factors(outer: nn.Module, experts: nn.Module) -> dict[str, tuple] | None:
    """{weight name: (lhs, rhs, scaling)}, `W + scaling * lhs @ rhs` being the weight PEFT makes of each weight the
    chain of wrappers from `outer` down to `experts` adapts, or None where [Note: factored LoRA on experts] does not
    apply (there PEFT's own computation runs). A wrapper with no active adapter leaves its weight as it is."""
    if not peft_experts.runs_factored(experts):
        return None
    allowed = peft_experts.weight_names(experts)
    factors: dict[str, tuple] = {}
    wrapper = outer
    while wrapper is not experts:
        name = wrapper.parameter_name
        param = experts._parameters.get(name)
        if (wrapper.disable_adapters or wrapper.merged or name not in allowed or name in factors or param is None
                or param.ndim != 3):
            return None
        if _active_adapters(wrapper):
            folded = folded_factors(wrapper, param)
            if folded is None:
                return None
            factors[name] = folded
        wrapper = wrapper.base_layer
    return factors


def _stateless_forward(self, x, *args, **kwargs):
    """`ParamWrapper.forward` (peft 0.21) with the parametrization replaced by a bind for the call
    ([Note: LoRA on parameters in layer copies]). `self` is a device's copy."""
    self._check_forward_args(x, *args, **kwargs)
    adapter_names = kwargs.pop("adapter_names", None)
    if self.disable_adapters and self.merged:
        # PEFT would unmerge here: subtract the delta from the weights in place, on one device's upload only.
        raise RuntimeError(
            f"PEFT adapters on the parameter {self.parameter_name!r} are merged into the weights and disabled: "
            f"RoundPipe cannot unmerge them on a device's copy. Call `model.unmerge_adapter()` (or keep the adapters "
            f"enabled) before wrapping the model.")
    if adapter_names is not None and not self.disable_adapters:
        raise ValueError(f"lora.{type(self).__name__} does not support mixed batch inference")
    if self.disable_adapters or self.merged:
        return self.base_layer(x, *args, **kwargs)
    module, name = self.get_base_layer(), self.parameter_name
    bound = module._parameters[name]
    effective = lora_parameter(self, bound)
    if effective is None:
        return self.base_layer(x, *args, **kwargs)
    module._parameters[name] = effective
    try:
        return self.base_layer(x, *args, **kwargs)
    finally:
        module._parameters[name] = bound


def make_param_wrappers_stateless(layer_copy: nn.Module) -> int:
    """Give every PEFT `ParamWrapper` in `layer_copy` (a device's own copy, never the user's module) the forward of
    [Note: LoRA on parameters in layer copies]; returns how many. A wrapper whose forward was already replaced on
    the instance (by a kernel patch) is refused: the replacement would be dropped without anyone knowing."""
    wrappers = param_wrappers(layer_copy)
    if not wrappers:
        return 0
    check_param_wrapper()
    for path, wrapper in wrappers:
        if "forward" in vars(wrapper):
            patched = getattr(vars(wrapper)["forward"], "__qualname__", "a patched forward")
            raise RuntimeError(
                f"The PEFT LoRA wrapper at {path!r} has a forward of its own on the instance ({patched}), which "
                f"RoundPipe's layer copies replace ([Note: LoRA on parameters in layer copies]): that forward would "
                f"be dropped. Apply no kernel patch to modules PEFT wraps (with RoundPipe's kernels='none', or "
                f"without the patch that set it).")
        if wrapper.parameter_name not in wrapper.get_base_layer()._parameters:
            raise RuntimeError(
                f"The PEFT LoRA wrapper at {path!r} targets {wrapper.parameter_name!r}, which its module holds other "
                f"than as a plain parameter (a parametrization of its own, a buffer): RoundPipe binds only "
                f"parameters into its layer copies. Put LoRA on plain parameters, or remove the parametrization "
                f"before wrapping the model.")
        wrapper.forward = MethodType(_stateless_forward, wrapper)
    for outer, experts in peft_experts.expert_chains(layer_copy, param_wrapper_class()):
        outer.forward = MethodType(_factored_forward(experts), outer)
    return len(wrappers)


def _factored_forward(experts: nn.Module):
    """The forward of the outermost wrapper over `experts` (in the same copy): [Note: factored LoRA on experts]
    where it applies, else the wrapper's stateless forward."""
    def forward(self, *args, **kwargs):
        if peft_experts.enabled and not kwargs and len(args) == 3:
            factors = chain_factors(self, experts)
            if factors is not None:
                return peft_experts.factored_experts_forward(experts, factors, *args)
        return _stateless_forward(self, *args, **kwargs)
    return forward
