"""[Note: first-pass micro-batches] through the engine on a CPU worker: a tiny GPT-OSS (eager attention) under an
injected budget that holds one row's transient but not two runs one row per micro-batch, and its loss and
gradients still equal the plain HF model's, in float64."""

from __future__ import annotations

import copy

import torch

from accelerate_roundpipe import RoundPipeConfig, wrap_model
from accelerate_roundpipe.plan.activation_estimate import row_activations
from accelerate_roundpipe.runtime.execution.measured_plan import PLAN_SHARE

from split_helpers import BATCH, SEQ, assert_close, assert_same_gradients, build_model, make_batch, reference_loss


def _budget_gib_for_one_row(model) -> float:
    """A budget whose planner share, less the weights a first-pass stage holds, fits 1.5 rows' estimate."""
    probe = wrap_model(copy.deepcopy(model), RoundPipeConfig(devices=["cpu"], summary=False))
    try:
        stage_bytes = probe._microbatches.sizer.stage_bytes
    finally:
        probe.close()
    per_row = row_activations(model.config, SEQ, torch.float64.itemsize).total_bytes
    return (stage_bytes + 1.5 * per_row) / PLAN_SHARE / 2**30


def test_a_tight_budget_raises_the_first_pass_count_and_training_is_unchanged():
    model = build_model("gpt_oss", output_router_logits=False)  # the aux loss does not split into micro-batches
    batch = make_batch("right")
    ref = copy.deepcopy(model)
    expected_loss = reference_loss(ref, batch)
    expected_loss.backward()
    expected = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                for n, p in ref.named_parameters() if p.requires_grad}

    engine = wrap_model(model, RoundPipeConfig(devices=["cpu"], gpu_memory_budget=_budget_gib_for_one_row(model)))
    counts = []
    split = engine._microbatches.split

    def recording_split(*args, **kwargs):
        rows, num_mb, pieces = split(*args, **kwargs)
        counts.append(num_mb)
        return rows, num_mb, pieces

    engine._microbatches.split = recording_split
    try:
        loss = engine.forward_backward(**batch)
        engine.synchronize()
        assert counts == [BATCH]  # one row per micro-batch, not the default 2
        sizing = engine.snapshot().first_pass
        assert sizing.raised and sizing.count == BATCH and sizing.default_count == 2
        assert_close(loss, expected_loss.detach(), "loss of forward_backward")
        grads = {n: p.grad.clone() for n, p in engine.named_parameters() if p.requires_grad}
        assert_same_gradients(grads, expected)
    finally:
        engine.close()


def test_a_roomy_budget_keeps_the_default():
    model = build_model("gpt_oss", output_router_logits=False)
    engine = wrap_model(model, RoundPipeConfig(devices=["cpu"], gpu_memory_budget=64, summary=False))
    try:
        assert engine.num_microbatches_for(BATCH, SEQ) == 2
        assert not engine._microbatches.sizing.raised
    finally:
        engine.close()
