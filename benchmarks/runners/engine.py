"""The engine API: `wrap_model` + `engine.wrap_optimizer(AdamW)`, then forward_backward / step / zero_grad.

With `accumulation` N > 1 a step is N `forward_backward` calls over consecutive row slices of the batch, each
gradient scaled by 1/N, then one `optimizer.step()`: gradient accumulation across calls, as the Trainer runs
`gradient_accumulation_steps` (the step's loss is the mean of the calls' losses, the batch's mean when every label
counts). The engine then plans one call's rows, not the global batch's, and holds every bucket's gradient until
the step."""

from __future__ import annotations

import torch

from accelerate_roundpipe import RoundPipeConfig, wrap_model
from benchmarks.memory import PeakMeter
from benchmarks.runners import common
from benchmarks.timing import StepClock, engine_waiter


def run_engine(model: torch.nn.Module, config: RoundPipeConfig, batch: dict, warm: int, iters: int,
               lr: float = 1e-5, accumulation: int = 1) -> dict:
    rows, seq = common.check_batch(batch, warm, iters)
    if accumulation < 1 or rows % accumulation:
        raise ValueError(f"accumulation={accumulation} must be >= 1 and divide the batch's {rows} rows.")
    call_rows = rows // accumulation
    calls = [{k: v[i * call_rows:(i + 1) * call_rows] for k, v in batch.items()} for i in range(accumulation)]
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
            call_losses = [engine.forward_backward(**call, grad_scale=1.0 / accumulation) for call in calls]
            losses.append(sum(loss.item() for loss in call_losses) / accumulation)
            optimizer.step()
            optimizer.zero_grad()
            clock.end(step)
        path = {"api": "wrap_model + forward_backward", "accumulation": accumulation,
                "optimizer": common.describe_optimizer(optimizer.inner),
                "optimizer_placement": common.placement_of(engine), "saved_inputs": common.saved_inputs_of(engine)}
        return common.run_result(clock, losses, rows, seq, engine.num_microbatches_for(call_rows, seq), meter,
                                 path)
    finally:
        common.close_engine(engine)
