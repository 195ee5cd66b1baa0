"""Tiled MLP: a decoder layer's MLP run over chunks of the sequence, its intermediates never whole in memory.

At long sequences the MLP's intermediates dominate a layer's activation memory (Qwen3-1.7B at 65,536 tokens: gate, up
and their product are 0.8 GB each, against 0.25 GB for the layer's input). `TiledMLP` keeps only the MLP's input for
the backward: the forward runs the MLP chunk by chunk without a graph, and the backward recomputes each chunk with a
graph and back-propagates it at once, so at most one chunk's intermediates exist at a time. The price is one more
forward of the MLP per backward (small beside the attention at the lengths where it is used). The parameters'
gradients accumulate as usual: the chunk backward reaches their `AccumulateGrad` nodes directly.

Used only where it is exact: an MLP whose forward is a pure per-token function (no dropout active, no router: MoE
blocks are left alone), and only for micro-batches of more than `mlp_chunk_tokens` tokens.
"""

from __future__ import annotations

from types import MethodType

import torch
from torch import nn

_PROJECTION_NAMES = ({"gate_proj", "up_proj", "down_proj"}, {"fc1", "fc2"}, {"w1", "w2", "w3"})


class _TiledMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mlp_forward, chunk_tokens: int, hidden: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.mlp_forward, ctx.chunk_tokens = mlp_forward, chunk_tokens
        ctx.save_for_backward(hidden)
        rows = hidden.reshape(-1, hidden.shape[-1])
        with torch.no_grad():
            out = torch.cat([mlp_forward(piece) for piece in rows.split(chunk_tokens)])
        return out.view(*hidden.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (hidden,) = ctx.saved_tensors
        rows = hidden.detach().reshape(-1, hidden.shape[-1])
        grads = grad_out.reshape(-1, grad_out.shape[-1])
        grad_rows = torch.empty_like(rows) if ctx.needs_input_grad[2] else None
        for start in range(0, rows.shape[0], ctx.chunk_tokens):
            piece = rows[start:start + ctx.chunk_tokens].detach().requires_grad_(grad_rows is not None)
            with torch.enable_grad():
                out = ctx.mlp_forward(piece)
            if out.requires_grad:  # parameters' gradients accumulate through their own AccumulateGrad nodes
                torch.autograd.backward(out, grads[start:start + ctx.chunk_tokens])
            if grad_rows is not None:
                grad_rows[start:start + ctx.chunk_tokens] = piece.grad if piece.grad is not None else 0
        grad_hidden = None if grad_rows is None else grad_rows.view_as(hidden)
        return (None, None, grad_hidden) + (None,) * (len(ctx.needs_input_grad) - 3)


def _tiled_forward(self, hidden: torch.Tensor) -> torch.Tensor:
    tokens = hidden.numel() // hidden.shape[-1]
    if tokens <= self._roundpipe_chunk_tokens or not torch.is_grad_enabled():
        return self._roundpipe_untiled_forward(hidden)
    # The parameters are passed only so the function's output requires grad when they do (LoRA on a frozen input).
    params = [p for p in self.parameters() if p.requires_grad]
    return _TiledMLPFunction.apply(self._roundpipe_untiled_forward, self._roundpipe_chunk_tokens, hidden, *params)


def tileable(mlp: nn.Module) -> bool:
    """A dense MLP made of known projections and no active dropout (so recomputing a chunk replays it exactly)."""
    names = {name for name, _ in mlp.named_children()}
    if not any(projections <= names for projections in _PROJECTION_NAMES):
        return False
    return not any(isinstance(m, nn.Dropout) and m.p > 0 for m in mlp.modules())


def tile_mlps(decoder_layers: list[nn.Module], chunk_tokens: int) -> int:
    """Make the `mlp` of every decoder layer that has a tileable one run tiled above `chunk_tokens` tokens; returns
    how many were tiled. Bound methods (not closures) so the engine's per-device layer copies call their own MLP."""
    if chunk_tokens < 1:
        raise ValueError(f"mlp_chunk_tokens must be at least 1, got {chunk_tokens}.")
    count = 0
    for layer in decoder_layers:
        mlp = getattr(layer, "mlp", None)
        if mlp is None or not tileable(mlp):
            continue
        if "_roundpipe_untiled_forward" not in mlp.__dict__:
            mlp._roundpipe_untiled_forward = mlp.__dict__.get("forward") or MethodType(type(mlp).forward, mlp)
        mlp._roundpipe_chunk_tokens = chunk_tokens
        mlp.forward = MethodType(_tiled_forward, mlp)
        count += 1
    return count
