"""LoRA on stacked MoE experts computed through its low-rank factors, on the engine's layer copies.
Written against transformers 5.24 (torch 2.13). Caller: `peft_internals.make_param_wrappers_stateless`, which
reads PEFT's factors (`chain_factors`, beside PEFT's own choice between its proxies) and passes them here.

[Note: factored LoRA on experts]
PEFT puts LoRA on an experts module's fused 3-D weights (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]) with one
`ParamWrapper` per weight, and runs it by making the whole weight `W + s * lhs @ rhs` for every call (one `baddbmm`
per weight, [Note: LoRA on parameters in layer copies]). For Qwen3-30B-A3B that is 1.2 GB of bf16 written and read
per layer per micro-batch in the forward, again in the recomputation, and in the backward the gradient of that whole
weight (as many FLOPs as the forward's expert products, over every expert) only to reduce it to the factors'
gradients. None of it shrinks with the micro-batch, so small micro-batches pay it per row.

Here the same function is computed the way LoRA on a linear layer is: for the rows routed to expert e,
`x @ W_e' = x @ W_e + s * (x @ P_e) @ Q_e` (P, Q the factors in the product's orientation), with torch's grouped GEMM
for all three products (`torch.nn.functional.grouped_mm`, the kernel transformers' "grouped_mm" experts run) and a
per-expert loop where that kernel does not take the tensors (float64, CPU, unaligned shapes). No weight-sized tensor
is made, the frozen weight gets no gradient, and the factors' gradients come from two thin products. The sums are
the same up to rounding (float64 parity with plain PEFT: tests/models/test_lora_on_experts.py).

It is used only where it computes exactly what PEFT would: the outermost `ParamWrapper` of a chain that ends at an
experts module dispatching on `config._experts_implementation` (`hf_experts.py`), naming "grouped_mm" or "eager";
every wrapper in the chain with one active adapter, not merged or disabled, on a stacked weight in a dtype PEFT does
not upcast (PEFT's `_LoraFactorsProxy` case); the weights targeted are the experts' up/gate and down weights; the
call is the three positional arguments every transformers MoE block passes; no expert parallelism. Anything else
runs PEFT's own computation through [Note: LoRA on parameters in layer copies].
"""

from __future__ import annotations

import torch
from torch import nn

from .hf_experts import GROUPED_MM_DTYPES, dispatching_experts, implementation_of

FACTORED_IMPLEMENTATIONS = ("grouped_mm", "eager")
# Off only to measure PEFT's own computation beside this one (benchmarks/moe_experts.py); read at each call.
enabled = True


def weight_names(experts: nn.Module) -> tuple[str, str]:
    """The experts' up (or fused gate and up) weight and down weight, by name."""
    return ("gate_up_proj" if experts.has_gate else "up_proj"), "down_proj"


def expert_chains(layer_copy: nn.Module, wrapper_class: type) -> list[tuple[nn.Module, nn.Module]]:
    """(outermost `ParamWrapper`, experts module) for every chain of wrappers in `layer_copy` that ends at a
    dispatching experts module."""
    experts_ids = {id(m) for _, m in dispatching_experts(layer_copy)}
    if not experts_ids:
        return []
    inner_ids = {id(m.base_layer) for m in layer_copy.modules() if isinstance(m, wrapper_class)}
    chains = []
    for module in layer_copy.modules():
        if not isinstance(module, wrapper_class) or id(module) in inner_ids:
            continue
        base = module
        while isinstance(base, wrapper_class):
            base = base.base_layer
        if id(base) in experts_ids:
            chains.append((module, base))
    return chains


def runs_factored(experts: nn.Module) -> bool:
    """Whether `experts` (a dispatching module) runs an implementation this forward stands in for, unsharded."""
    return (implementation_of(experts) in FACTORED_IMPLEMENTATIONS
            and not getattr(experts, "_is_expert_parallel", False)
            and not (getattr(experts, "has_post_expert_norm", False) and not hasattr(experts, "post_expert_norm")))


def _kernel_takes(matrix: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM takes `matrix` (2-D rows or a 3-D stack) as it is: CUDA, a dtype it has,
    16-byte aligned, one of the last two dimensions contiguous and the other's stride 16-byte aligned."""
    if matrix.device.type != "cuda" or matrix.dtype not in GROUPED_MM_DTYPES:
        return False
    size = matrix.element_size()
    if matrix.data_ptr() % 16:
        return False
    rows, cols = matrix.stride(-2), matrix.stride(-1)
    return (cols == 1 and rows * size % 16 == 0) or (rows == 1 and cols * size % 16 == 0)


class _Groups:
    """The rows of one call sorted by expert, and the products over them."""

    def __init__(self, counts: torch.Tensor, kernel: bool) -> None:
        self.kernel = kernel
        self.offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        self.spans = None  # (start, end) of each expert's rows, read from the device only where the loop needs them

    def product(self, rows: torch.Tensor, stack: torch.Tensor) -> torch.Tensor:
        """rows [S, a] (grouped by expert) @ stack [E, a, b], expert by expert -> [S, b]."""
        stack = stack.to(rows.dtype)
        if self.kernel:
            if not _kernel_takes(stack):
                stack = stack.contiguous()
            if _kernel_takes(rows) and _kernel_takes(stack):
                return torch.nn.functional.grouped_mm(rows, stack, offs=self.offsets)
        pieces = [rows[start:end] @ stack[e] for e, (start, end) in enumerate(self._spans()) if end > start]
        return torch.cat(pieces) if pieces else rows.new_zeros(0, stack.size(-1))

    def _spans(self):
        if self.spans is None:
            ends = self.offsets.tolist()
            self.spans = list(zip([0, *ends[:-1]], ends))
        return self.spans

    def linear(self, rows: torch.Tensor, weight: torch.Tensor, transposed: bool, factors: tuple | None):
        """rows @ W_e' for each expert's rows, W' = W + s * lhs @ rhs as PEFT makes it, W stored [E, in, out] when
        `transposed`, else [E, out, in]."""
        out = self.product(rows, weight if transposed else weight.transpose(-2, -1))
        if factors is None:
            return out
        lhs, rhs, scaling = factors
        # transposed: x @ (W + s lhs rhs) = x W + s (x lhs) rhs; else x @ (W + s lhs rhs)^T = x W^T + s (x rhs^T) lhs^T
        first, second = (lhs, rhs) if transposed else (rhs.transpose(-2, -1), lhs.transpose(-2, -1))
        thin = self.product(rows, first) * scaling
        return out + self.product(thin, second)


class _PairRows(torch.autograd.Function):
    """hidden [T, H] -> the rows of its (token, expert) pairs in expert order: `hidden[order // top_k]`.

    Autograd's backward of that gather is a sort-based scatter-add over all S = T * top_k rows (5 ms a step for 4
    Qwen3-30B-A3B layers at 16K tokens, `benchmarks/moe_layer_profile.py`). Each token has exactly `top_k` pairs, so
    the gradient is a gather by the inverse permutation and a sum over each token's pairs in a fixed order."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, top_k: int) -> torch.Tensor:
        ctx.save_for_backward(order, inverse)
        ctx.top_k = top_k
        return hidden[order // top_k]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        order, inverse = ctx.saved_tensors
        return _PairSum.apply(grad, order, inverse, ctx.top_k), None, None, None


class _PairSum(torch.autograd.Function):
    """rows [S, H] of the pairs in expert order -> each token's sum over its pairs [T, H], in the pairs' own order
    (`rows[inverse].view(T, top_k, H).sum(1)`); the backward is `_PairRows`'s gather (each other's adjoint)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, top_k: int) -> torch.Tensor:
        ctx.save_for_backward(order, inverse)
        ctx.top_k = top_k
        return rows[inverse].view(-1, top_k, rows.shape[-1]).sum(dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        order, inverse = ctx.saved_tensors
        return _PairRows.apply(grad, order, inverse, ctx.top_k), None, None, None


def factored_experts_forward(experts: nn.Module, factors: dict[str, tuple], hidden: torch.Tensor,
                             top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts' forward of [Note: factored LoRA on experts]: each (token, chosen expert) pair through that
    expert's up/gate and down weights with their LoRA, weighted by its routing weight, summed over a token's
    experts in a fixed order.

    Where nothing follows the down projection but its product (no bias, no norm after the experts), the routing
    weight scales the pair's activations before it ((w u) W = w (u W)): a broadcast multiply over I columns
    instead of H (768 against 2048 for Qwen3-30B-A3B), the costliest elementwise kernel of the layer."""
    top_k = top_k_index.shape[-1]
    gate_name, down_name = weight_names(experts)
    gate_weight, down_weight = getattr(experts, gate_name), getattr(experts, down_name)
    kernel = (implementation_of(experts) == "grouped_mm" and hidden.device.type == "cuda"
              and gate_weight.dtype in GROUPED_MM_DTYPES)
    expert_of_pair = top_k_index.reshape(-1)
    sorted_experts, order = torch.sort(expert_of_pair, stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    groups = _Groups(torch.bincount(expert_of_pair, minlength=experts.num_experts), kernel)
    rows = _PairRows.apply(hidden, order, inverse, top_k).to(gate_weight.dtype)
    weights = top_k_weights.reshape(-1)[order].unsqueeze(-1)
    post_norm = getattr(experts, "has_post_expert_norm", False)  # transformers < 5.24 has no such attribute
    weight_early = not experts.has_bias and not post_norm

    up = groups.linear(rows, gate_weight, experts.is_transposed, factors.get(gate_name))
    if experts.has_bias:
        up = up + getattr(experts, gate_name + "_bias")[sorted_experts]
    up = experts._apply_gate(up) if experts.has_gate else experts.act_fn(up)
    if weight_early:
        up = up * weights.to(up.dtype)
    down = groups.linear(up, down_weight, experts.is_transposed, factors.get(down_name))
    if experts.has_bias:
        down = down + getattr(experts, down_name + "_bias")[sorted_experts]
    if post_norm:
        down = experts.post_expert_norm(down)
    if not weight_early:
        down = down * weights.to(down.dtype)
    return _PairSum.apply(down, order, inverse, top_k).to(hidden.dtype)
