"""The reaches into transformers' experts implementations ([Note: compatibility reaches]): which modules dispatch
their forward on `config._experts_implementation`, and setting that on a device's layer copy. Written against
transformers 5.24 and torch 2.13. Caller: `models/layers.py` ([Note: experts implementation of layer copies]).

transformers 5 stores the experts of most MoE families as 3-D parameters in one module whose class is decorated by
`transformers.integrations.moe.use_experts_implementation`: its forward looks up
`self.config._experts_implementation` on every call ("eager": the class's own loop over experts; "grouped_mm",
"batched_mm" and others: `ALL_EXPERTS_FUNCTIONS`). A model built without the setting gets "grouped_mm" on every
device (`PreTrainedModel.get_correct_experts_implementation`), whose kernel (`torch.nn.functional.grouped_mm`)
takes bfloat16, float16 and float32 only: a float64 model fails in its first experts call.
"""

from __future__ import annotations

import importlib
import sys

import torch
from torch import nn

from . import LibraryChangedError, _code_objects, require_attribute, require_mention

LIBRARY = "transformers"
MOE_MODULE = "transformers.integrations.moe"
REACH = ("transformers.integrations.moe.use_experts_implementation (the experts forward that reads "
         "config._experts_implementation, set on each device's layer copy)")
# The dtypes torch's grouped GEMM takes (torch 2.13, CPU and CUDA: "Expected mat_a to be Float32, BFloat16 or
# Float16"); transformers' "grouped_mm" calls it for every other dtype too.
GROUPED_MM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _dispatching_forward_code():
    """The code of the forward `use_experts_implementation` gives a class (its nested `forward`), or None when
    transformers' MoE integration was never imported (then no model holds such experts)."""
    moe = sys.modules.get(MOE_MODULE)
    if moe is None:
        return None
    decorator = require_attribute(moe, "use_experts_implementation", LIBRARY, REACH)
    codes = [code for code in _code_objects(decorator) if code.co_name == "forward"]
    if len(codes) != 1:
        raise LibraryChangedError(LIBRARY, REACH, f"use_experts_implementation defines {len(codes)} functions named "
                                                  "`forward`, not one")
    return codes[0]


def dispatching_experts(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The experts modules in `module` whose forward dispatches on `config._experts_implementation` (their class
    decorated by `use_experts_implementation`), with their paths."""
    code = _dispatching_forward_code()
    if code is None:
        return []
    found = []
    for path, child in module.named_modules(remove_duplicate=False):
        forward = getattr(type(child).forward, "__code__", None)
        if forward is code:
            found.append((path, child))
    if found:
        check_experts_dispatch()
    return found


def check_experts_dispatch() -> None:
    """The decorated forward still reads `config._experts_implementation` and asks `get_interface` for the
    function; the config's property still keeps its value in `_experts_implementation_internal`, which
    `set_experts_implementation` sets (and `set_implementation` sets here)."""
    moe = importlib.import_module(MOE_MODULE)
    code = _dispatching_forward_code()
    for name in ("_experts_implementation", "get_interface", "config"):
        if name not in code.co_names:
            raise LibraryChangedError(LIBRARY, REACH, f"the experts forward of use_experts_implementation no longer "
                                                      f"looks up `{name}`")
    interface = require_attribute(moe, "ALL_EXPERTS_FUNCTIONS", LIBRARY, REACH)
    require_attribute(interface, "get_interface", LIBRARY, REACH)
    from transformers import PretrainedConfig

    getter = getattr(vars(PretrainedConfig).get("_experts_implementation"), "fget", None)
    if getter is None:
        raise LibraryChangedError(LIBRARY, REACH, "PretrainedConfig._experts_implementation is no longer a property")
    require_mention(getter, "_experts_implementation_internal", LIBRARY, REACH)


def implementation_of(experts: nn.Module) -> str | None:
    """The implementation `experts` (a dispatching module) runs on its next call."""
    return experts.config._experts_implementation


def set_implementation(experts: nn.Module, name: str) -> None:
    """Make `experts`' config name `name` (on its own config object: a device's copy's, never the user's), as
    `PreTrainedModel.set_experts_implementation` does: the internal attribute, not the property's setter (which
    would walk sub-configs the copy does not run)."""
    experts.config._experts_implementation_internal = name


def runnable_implementation(name: str | None, dtype: torch.dtype) -> str | None:
    """`name`, or "eager" where `name` has no kernel for `dtype` ("grouped_mm" in float64: torch's grouped GEMM
    refuses it; the eager loop computes the same sums with `linear`, which takes every dtype)."""
    if name == "grouped_mm" and dtype not in GROUPED_MM_DTYPES:
        return "eager"
    return name
