"""A stock Accelerate loop, docs/ways-in.md's way 1: `RoundPipeAccelerator(roundpipe_plugin=RoundPipePlugin(...))`,
prepare, then `loss = model(**batch).loss; accelerator.backward(loss); optimizer.step(); optimizer.zero_grad()`."""

from __future__ import annotations

import dataclasses

import torch

from accelerate_roundpipe import RoundPipeAccelerator, RoundPipeConfig, RoundPipePlugin
from accelerate_roundpipe.integrations.convert import engine_of
from benchmarks.memory import PeakMeter
from benchmarks.runners import common
from benchmarks.timing import StepClock, engine_waiter


def run_accelerate_loop(model: torch.nn.Module, config: RoundPipeConfig, batch: dict, warm: int, iters: int,
                        lr: float = 1e-5) -> dict:
    rows, seq = common.check_batch(batch, warm, iters)
    common.reset_accelerate_state()
    cuda = common.cuda_indices(config)
    meter = PeakMeter(cuda)
    plugin = RoundPipePlugin(**{f.name: getattr(config, f.name) for f in dataclasses.fields(RoundPipeConfig)})
    precision = "bf16" if common.is_bf16(model) else "no"
    accelerator = RoundPipeAccelerator(roundpipe_plugin=plugin, mixed_precision=precision)
    engine = None
    try:
        optimizer = common.fused_adamw([p for p in model.parameters() if p.requires_grad], lr)
        model, optimizer = accelerator.prepare(model, optimizer)
        engine = engine_of(model)
        model.train()
        clock = StepClock(warm, iters, engine_waiter(lambda: engine, cuda))
        losses = []
        for step in range(warm + iters):
            clock.begin(step)
            loss = model(**batch).loss
            accelerator.backward(loss)
            losses.append(loss.item())
            optimizer.step()
            optimizer.zero_grad()
            clock.end(step)
        path = {"api": "RoundPipeAccelerator(roundpipe_plugin=RoundPipePlugin(...)) stock loop",
                "mixed_precision": precision, "optimizer": common.describe_optimizer(optimizer.optimizer.inner),
                "optimizer_placement": common.placement_of(engine), "saved_inputs": common.saved_inputs_of(engine)}
        return common.run_result(clock, losses, rows, seq, engine.num_microbatches_for(rows, seq), meter, path)
    finally:
        common.close_engine(engine)
        common.reset_accelerate_state()
