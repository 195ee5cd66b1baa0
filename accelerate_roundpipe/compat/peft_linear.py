"""PEFT's LoRA on a linear layer with its low-rank product added inside one GEMM, on the engine's layer copies.
Written against peft 0.21 (torch 2.13). Caller: `runtime/execution/layer_copy.py` (each device's copy of a layer).

[Note: LoRA added in the GEMM]
PEFT's `lora.Linear.forward` computes `result = base(x)` and then, per adapter, `result = result + B(A(drop(x))) *
scaling`: the product `B(A(.))` is written as a [tokens, out] tensor, multiplied by `scaling` into a second, and added
to `result` into a third. For Llama-3.1-8B's seven LoRA targets at 16K tokens a micro-batch, each such pass is 1.4 GB
of bf16: the forward makes six of them beyond the base product (and the recomputation six more), and autograd's
backward of the multiplication one more pair. `torch.addmm(result, a, B^T, alpha=scaling)` computes the same sum
with the base output read once and the sum written once, inside the GEMM whose inner dimension is the rank; its
backward hands the output gradient to the base product as it is (beta = 1) and scales only the rank-wide products.
The sums are the same up to rounding (one rounding of the scaled product and the sum, where PEFT rounds three
times; float64 parity with PEFT: tests/models/test_lora_linear_fused.py).

It is used only where it computes what PEFT would: a `lora.Linear` over an `nn.Linear`, called with the input
alone, adapters neither merged nor disabled, every active adapter vanilla LoRA (no variant such as DoRA, no LoRA
bias), its factors plain `nn.Linear`s in the dtype of the input and of the base weight (PEFT would cast the input
and promote the sum otherwise) and a number for its scaling. Anything else runs PEFT's own forward, decided per
call before anything is computed. The dropout runs as PEFT runs it (once per adapter, in the same order), so the
random streams are the ones PEFT would draw. Only the devices' copies get this forward: the user's model keeps
PEFT's, so merging and saving are PEFT's own.
"""

from __future__ import annotations

import functools
import logging
import sys
from types import MethodType

import torch
from torch import nn

from . import mentions

logger = logging.getLogger(__name__)

LIBRARY = "peft"
LAYER_MODULE = "peft.tuners.lora.layer"
# What PEFT's `lora.Linear.forward` reads, which the fused forward reproduces; when one is no longer read, PEFT's
# forward changed and its own forward is kept (slower, never different).
_FORWARD_LOOKUPS = ("disable_adapters", "merged", "base_layer", "active_adapters", "lora_A", "lora_B",
                    "lora_dropout", "scaling", "lora_variant", "_cast_input_dtype")
# Off only to measure PEFT's own computation beside this one (benchmarks); read at each call.
enabled = True


def _linear_class() -> type | None:
    """PEFT's `lora.Linear`, or None when PEFT's LoRA layers were never imported (then no model holds one)."""
    layer = sys.modules.get(LAYER_MODULE)
    return None if layer is None else getattr(layer, "Linear", None)


@functools.cache  # per function: its code cannot change under a running process ([Note: compat checks run once])
def _forward_unchanged(forward) -> bool:
    """Whether PEFT's `Linear.forward` still reads what the fused forward copies. The layer copies are made on the
    workers' threads, so this is asked from several: a cache, not a dictionary of this module's to keep."""
    missing = [name for name in _FORWARD_LOOKUPS if not mentions(forward, name)]
    if missing:
        logger.warning("peft's lora.Linear.forward no longer reads %s: RoundPipe's layer copies run PEFT's own "
                       "forward ([Note: LoRA added in the GEMM] in compat/peft_linear.py).", missing)
    return not missing


def fuse_lora_adds(layer_copy: nn.Module) -> int:
    """Give every PEFT `lora.Linear` in `layer_copy` (a device's own copy, never the user's module) the forward of
    [Note: LoRA added in the GEMM]; returns how many. A module whose forward was already replaced on the instance
    keeps it."""
    linear_class = _linear_class()
    if linear_class is None or not _forward_unchanged(linear_class.forward):
        return 0
    count = 0
    for module in layer_copy.modules():
        if type(module) is linear_class and "forward" not in vars(module):
            module.forward = MethodType(_fused_forward, module)
            count += 1
    return count


def _vanilla_adapters(self, x: torch.Tensor) -> list[str] | None:
    """The active adapters when the fused forward computes what PEFT's would for input `x`, else None."""
    if self.disable_adapters or self.merged or type(self.base_layer) is not nn.Linear:
        return None
    dtype = x.dtype
    if self.base_layer.weight.dtype != dtype:
        return None
    variants, dora = getattr(self, "lora_variant", {}), getattr(self, "use_dora", {})
    adapters = [a for a in self.active_adapters if a in self.lora_A]
    for a in adapters:
        lora_A, lora_B = self.lora_A[a], self.lora_B[a]
        if a in variants or dora.get(a, False) or type(lora_A) is not nn.Linear or type(lora_B) is not nn.Linear:
            return None
        if lora_A.bias is not None or lora_B.bias is not None or not isinstance(self.scaling[a], (int, float)):
            return None
        if lora_A.weight.dtype != dtype or lora_B.weight.dtype != dtype:
            return None
    return adapters


def _fused_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """`lora.Linear.forward` (peft 0.21) with each adapter's product added inside one GEMM
    ([Note: LoRA added in the GEMM]); PEFT's own forward wherever that would differ."""
    adapters = _vanilla_adapters(self, x) if enabled and not args and not kwargs else None
    if adapters is None:
        return type(self).forward(self, x, *args, **kwargs)
    result = self.base_layer(x)
    if not adapters:
        return result
    shape = result.shape
    total = result.reshape(-1, shape[-1])
    for a in adapters:
        low = self.lora_A[a](self.lora_dropout[a](x))
        total = torch.addmm(total, low.reshape(-1, low.shape[-1]), self.lora_B[a].weight.t(), alpha=self.scaling[a])
    return total.view(shape)
