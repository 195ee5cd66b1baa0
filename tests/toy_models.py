"""Small float64 models and plain-PyTorch references shared by the engine tests."""

from __future__ import annotations

import copy

import torch
from torch import nn

from accelerate_roundpipe.runtime.execution.rng_streams import stream_seed

WIDTH = 6


class Embed(nn.Module):
    """Layer 0: (x, mask) -> (h, mask); its weight is tied to the head's."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor, mask: torch.Tensor):
        return torch.tanh(self.linear(x)), mask


class Block(nn.Module):
    """A residual block that passes an integer mask through (a non-float activation)."""

    def __init__(self, width: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, h: torch.Tensor, mask: torch.Tensor):
        update = self.dropout(torch.tanh(self.linear(h))) * mask[:, None].to(h.dtype)
        return h + update, mask


class Split(nn.Module):
    """Returns two float activations (a tuple) consumed by `Merge`."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, h: torch.Tensor, mask: torch.Tensor):
        return h, torch.sin(self.linear(h)), mask


class Merge(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor):
        return a * b + a, mask


class Head(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, h: torch.Tensor, mask: torch.Tensor):
        return self.linear(h)


def tied_model(dropout: float = 0.0, seed: int = 0, num_blocks: int = 5) -> nn.Sequential:
    """>= 8 layers in float64; the first and the last layer share one weight; dropout in one block."""
    torch.manual_seed(seed)
    first = nn.Linear(WIDTH, WIDTH)
    last = nn.Linear(WIDTH, WIDTH)
    last.weight = first.weight
    blocks = [Block(WIDTH, dropout if i == 1 else 0.0) for i in range(num_blocks)]
    layers = [Embed(first), blocks[0], Split(WIDTH), Merge(), *blocks[1:], Head(last)]
    return nn.Sequential(*layers).double()


def batch(rows: int = 11, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, WIDTH, generator=gen, dtype=torch.float64)
    mask = (torch.rand(rows, generator=gen) > 0.2).long()
    y = torch.randint(0, WIDTH, (rows,), generator=gen)
    return x, mask, y


def train_tied_model(set_to_none: bool = True, clip: float | None = None, calls: int = 1, steps: int = 4,
                     num_devices: int = 2, async_optimizer: bool = False):
    """`steps` AdamW steps of the engine on `tied_model()` (CPU workers, 2 micro-batches), each over `calls`
    forward_backward calls (scaled by 1 / calls), clipped to `clip`, then `zero_grad(set_to_none)`: the losses and
    the final weights, for comparing two ways of training bitwise."""
    from accelerate_roundpipe import RoundPipe, RoundPipeConfig

    torch.manual_seed(0)
    engine = RoundPipe(tied_model(), RoundPipeConfig(devices=["cpu"] * num_devices, num_microbatches=2,
                                                     async_optimizer=async_optimizer))
    optimizer = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-2))
    losses = []
    for step in range(steps):
        for call in range(calls):
            x, mask, y = batch(rows=8, seed=10 * step + call)
            loss = engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy,
                                           grad_scale=1.0 / calls)
            losses.append(loss.detach().clone())
        if clip is not None:
            optimizer.clip_grad_norm_(clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)
    engine.synchronize()
    weights = {name: p.detach().clone() for name, p in engine.named_parameters()}
    engine.close()
    return torch.stack(losses), weights


def run_layers(model: nn.Sequential, inputs: tuple, seeds: list[int] | None = None):
    h = inputs
    for index, layer in enumerate(model):
        if seeds is not None:
            torch.manual_seed(seeds[index])
        h = layer(*h) if isinstance(h, tuple) else layer(h)
    return h


def reference_loss_and_grads(model: nn.Sequential, x, mask, y, num_microbatches: int | None = None,
                             base_seed: int = 0, pass_index: int = 0):
    """Plain PyTorch. Without `num_microbatches`: the whole batch at once. With it: the same micro-batches and the
    same per-layer RNG seeds as the engine (for dropout), losses weighted by their share of rows."""
    model = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    if num_microbatches is None:
        loss = nn.functional.cross_entropy(run_layers(model, (x, mask)), y)
        loss.backward()
    else:
        rows = x.shape[0]
        loss = 0.0
        for mb, (xs, ms, ys) in enumerate(zip(*(torch.tensor_split(t, num_microbatches) for t in (x, mask, y)))):
            seeds = [stream_seed(base_seed, pass_index, layer, mb) for layer in range(len(model))]
            part = nn.functional.cross_entropy(run_layers(model, (xs, ms), seeds), ys) * (xs.shape[0] / rows)
            part.backward()
            loss = loss + part.detach()
    grads = {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
    return loss.detach(), grads


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, what: str) -> None:
    scale = expected.abs().max().clamp_min(1e-30)
    err = (actual.to(expected.dtype) - expected).abs().max()
    assert err <= rtol * scale, f"{what}: max error {err:.3e} > {rtol:.0e} x {scale:.3e}"


def plain_adamw_training(make_model, batches, max_norm: float, lr: float, weight_decay: float,
                         lagged: bool = False, fresh=frozenset()):
    """Plain PyTorch AdamW on `make_model()`: the accumulated gradients of each step's passes, clipped to
    `max_norm`; (the norms, the weights after each step). Exact: every pass computes with the newest weights.
    Lagged: the parameters in `fresh` (device buckets step exactly) too; the others, in every pass of the iteration
    after step k-1, with the weights from before that step (the held write-back lands at the next step, once all
    the iteration's passes reserved their reads)."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)

    def snapshot() -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in model.named_parameters()}

    previous = snapshot()
    norms, weights = [], []
    for passes in batches:
        current = snapshot()
        grads: dict[str, torch.Tensor] = {}
        for x, mask, y in passes:
            probe = make_model()
            with torch.no_grad():
                for name, p in probe.named_parameters():
                    p.copy_(previous[name] if lagged and name not in fresh else current[name])
            nn.functional.cross_entropy(run_layers(probe, (x, mask)), y).backward()
            for name, p in probe.named_parameters():
                grads[name] = grads[name] + p.grad if name in grads else p.grad.clone()
        for name, p in model.named_parameters():
            p.grad = grads[name]
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        optimizer.step()
        optimizer.zero_grad()
        previous = current
        weights.append(snapshot())
    return norms, weights
