"""The engine API: `wrap_model` + `engine.wrap_optimizer(AdamW)`, then forward_backward / step / zero_grad."""

from __future__ import annotations

import torch

from accelerate_roundpipe import RoundPipeConfig, wrap_model
from benchmarks.memory import PeakMeter
from benchmarks.runners import common
from benchmarks.timing import StepClock, engine_waiter


def run_engine(model: torch.nn.Module, config: RoundPipeConfig, batch: dict, warm: int, iters: int,
               lr: float = 1e-5) -> dict:
    rows, seq = common.check_batch(batch, warm, iters)
    cuda = common.cuda_indices(config)
    meter = PeakMeter(cuda)
    engine = None
    try:
        engine = wrap_model(model, config)
        trainable = [p for p in engine.parameters() if p.requires_grad]
        optimizer = engine.wrap_optimizer(common.fused_adamw(trainable, lr))
        clock = StepClock(warm, iters, engine_waiter(lambda: engine, cuda))
        losses = []
        for step in range(warm + iters):
            clock.begin(step)
            loss = engine.forward_backward(**batch)
            losses.append(loss.item())
            optimizer.step()
            optimizer.zero_grad()
            clock.end(step)
        path = {"api": "wrap_model + forward_backward", "optimizer": common.describe_optimizer(optimizer.inner),
                "optimizer_placement": common.placement_of(engine)}
        return common.run_result(clock, losses, rows, seq, engine.num_microbatches_for(rows, seq), meter, path)
    finally:
        common.close_engine(engine)
