"""What each rank runs in `test_unreached_across_ranks.py`: layers whose parameters the loss reaches on some ranks
and not others, decided by each rank's own rows ([Note: parameters no rank reaches]), against plain torch on the
global batch (the sum of the ranks' losses, each over its own rows, so each rank's branches are its own)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from accelerate_roundpipe import RoundPipe, RoundPipeConfig

WIDTH = 8
ROWS_PER_RANK = 3


class Gated(nn.Module):
    """Always `main`; `side` only where the rows' first flag (feature 0) is positive. Features 0 and 1 are flags,
    passed on unchanged."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.main = nn.Linear(WIDTH, WIDTH, dtype=torch.float64)
        self.side = nn.Linear(WIDTH, WIDTH, dtype=torch.float64)
        with torch.no_grad():
            for linear in (self.main, self.side):
                linear.weight.copy_(torch.randn(linear.weight.shape, generator=generator, dtype=torch.float64) / WIDTH)
                linear.bias.copy_(torch.randn(WIDTH, generator=generator, dtype=torch.float64) / WIDTH)

    def forward(self, x):
        h = self.main(x)
        if bool(x[0, 0] > 0):
            h = h + self.side(x)
        return torch.cat([x[:, :2], torch.tanh(h[:, 2:])], dim=1)


class Skippable(nn.Module):
    """The whole layer is skipped (the input passed on: none of its parameters reached) where the second flag is
    negative: a bucket with no gradient at all on that rank."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.proj = nn.Linear(WIDTH, WIDTH, dtype=torch.float64)
        with torch.no_grad():
            self.proj.weight.copy_(torch.randn(WIDTH, WIDTH, generator=generator, dtype=torch.float64) / WIDTH)
            self.proj.bias.copy_(torch.randn(WIDTH, generator=generator, dtype=torch.float64) / WIDTH)

    def forward(self, x):
        if bool(x[0, 1] < 0):
            return x
        return torch.cat([x[:, :2], torch.tanh(self.proj(x)[:, 2:])], dim=1)


def layers() -> nn.Sequential:
    return nn.Sequential(Gated(0), Skippable(1), Gated(2), Skippable(3))


# Per step, per rank: (side branches used, skippable layers run).
FLAGS = [
    [(False, True), (False, True)],    # side reached by no rank
    [(False, False), (True, True)],    # side by rank 1 only; the skippable layers by rank 1 only
    [(True, False), (True, False)],    # the skippable layers by no rank
    [(False, True), (False, False)],   # side by none; skippable by rank 0 only
    [(True, True), (True, True)],      # everything by everyone
]


def rank_batch(step: int, rank: int) -> torch.Tensor:
    x = torch.randn(ROWS_PER_RANK, WIDTH, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(1000 + 10 * step + rank))
    side, run = FLAGS[step][rank]
    x[:, 0] = 1.0 if side else -1.0
    x[:, 1] = 1.0 if run else -1.0
    return x


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.square().sum()


def adamw(params) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def reference(world_size: int, clip: float | None = None) -> tuple[nn.Module, torch.optim.AdamW]:
    """Plain torch on the global batch: the sum of the ranks' losses; a parameter no rank's loss reached keeps
    `.grad` None and AdamW skips it."""
    model = layers()
    optimizer = adamw(model.parameters())
    for step in range(len(FLAGS)):
        optimizer.zero_grad()
        sum(loss_of(model(rank_batch(step, r))) for r in range(world_size)).backward()
        if clip is not None:  # the parameters without a gradient left out, as torch's clip leaves them
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
    return model, optimizer


def _engine_run(rank_passes: list[int], data_parallel: bool, settings: dict) -> dict[str, torch.Tensor]:
    """The engine over `layers()`, one pass per rank of `rank_passes` per step (clipped to `settings["clip"]`
    where given); its weights at the end."""
    settings = dict(settings)
    clip = settings.pop("clip", None)
    engine = RoundPipe(copy.deepcopy(layers()), RoundPipeConfig(
        devices=["cpu"], num_microbatches=1, seed=0, wait_timeout_s=30, summary=False, data_parallel=data_parallel,
        **settings))
    try:
        optimizer = engine.wrap_optimizer(adamw(engine.parameters()))
        for step in range(len(FLAGS)):
            for rank in rank_passes:
                engine.forward_backward(rank_batch(step, rank), loss_fn=loss_of, loss_reduction="sum")
            if clip is not None:
                optimizer.clip_grad_norm_(clip)
            optimizer.step()
            optimizer.zero_grad()
        engine.synchronize()
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    finally:
        engine.close()


def one_process_weights(world_size: int, settings: dict) -> dict[str, torch.Tensor]:
    """What one process gets from every rank's rows (run where there is no process group): plain torch, or for the
    lagged step (each step's passes read the weights one step old) the one-process engine with a pass per rank,
    whose unreached parameters equal plain torch's (`tests/test_params_without_grad.py`)."""
    if settings.get("async_optimizer"):
        return _engine_run(list(range(world_size)), False, settings)
    return {n: p.detach().clone() for n, p in reference(world_size, settings.get("clip"))[0].named_parameters()}


def trains_as_one_process(rank: int, world_size: int, settings: dict, expected: dict[str, torch.Tensor]) -> dict:
    """This rank's rows on the data-parallel engine end at `one_process_weights`."""
    got = _engine_run([rank], True, settings)
    for name, weight in expected.items():
        torch.testing.assert_close(got[name], weight, rtol=1e-10, atol=1e-12,
                                   msg=lambda m, name=name: f"rank {rank}, {name}: {m}")
    return {"weights": sorted(got)}
