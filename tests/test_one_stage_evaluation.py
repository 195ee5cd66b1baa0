"""A forward pass without gradients runs as one task over every layer when there is one device and every bucket's
weights are at home there ([Note: one-stage evaluation]): the outputs are plain PyTorch's, the task the trace
records is that one, and every other pass keeps the training partition's stages."""

from __future__ import annotations

import json

import torch
from torch import nn

from accelerate_roundpipe import RoundPipe, RoundPipeConfig
from accelerate_roundpipe.plan.schedule import TaskKind

from toy_models import batch, plain_adamw_training, run_layers, tied_model

LR, WEIGHT_DECAY, MAX_NORM = 1e-2, 0.1, 3.0
STEPS = 3


def _batches() -> list[tuple]:
    return [batch(rows=8, seed=10 * step) for step in range(STEPS)]


def _engine(devices: list[str], placement: str, lagged: bool = False, trace_path=None,
            freeze_layer: int | None = None) -> tuple[RoundPipe, torch.optim.Optimizer]:
    model = tied_model()
    if freeze_layer is not None:
        model[freeze_layer].requires_grad_(False)
    engine = RoundPipe(model, RoundPipeConfig(devices=devices, num_microbatches=2, summary=False,
                                              optimizer_placement=placement, async_optimizer=lagged,
                                              trace_path=trace_path))
    params = [p for p in engine.parameters() if p.requires_grad]
    optimizer = engine.wrap_optimizer(torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY))
    return engine, optimizer


def _train(engine: RoundPipe, optimizer) -> None:
    for x, mask, y in _batches():
        engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy)
        optimizer.clip_grad_norm_(MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()


def _plain_outputs(x, mask) -> torch.Tensor:
    """Plain PyTorch: the same clipped AdamW steps, then the trained model's outputs."""
    _, weights = plain_adamw_training(tied_model, [[b] for b in _batches()], MAX_NORM, LR, WEIGHT_DECAY)
    model = tied_model()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights[-1][name])
        return run_layers(model, (x, mask))


def _traced_tasks(path) -> list[str]:
    """The tasks a trace recorded on the workers' host tracks, in order."""
    trace = json.loads(path.read_text())
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    return [e["name"] for e in trace["traceEvents"] if e["ph"] == "X" and names[e["tid"]].endswith(" host")]


def _one_stage(tasks) -> bool:
    return len(tasks) == 1 and tasks[0].kind is TaskKind.FORWARD and tuple(tasks[0].span.layers) == tuple(range(9))


def test_an_evaluation_runs_one_task_over_every_layer_and_computes_plain_pytorchs_outputs(tmp_path):
    path = tmp_path / "trace.json"
    engine, optimizer = _engine(["cpu"], "device", trace_path=str(path))
    try:
        assert len(engine.schedule(2, "forward")) > 1  # the training partition has stages: they are not run here
        assert _one_stage(engine.evaluation_schedule(2)), engine.evaluation_schedule(2)
        _train(engine, optimizer)
        x, mask, _ = batch(rows=6, seed=99)
        with torch.no_grad():
            ours = engine(x, mask)
        torch.testing.assert_close(ours, _plain_outputs(x, mask), rtol=1e-12, atol=1e-12)
    finally:
        engine.close()
    tasks = _traced_tasks(path)
    forward_tasks = [t for t in tasks if t.startswith("F")]
    # The training passes ran their forward stages; the evaluation one task over layers 0-8.
    assert forward_tasks[-1].startswith("F0:L0-8"), tasks


def test_the_lagged_step_evaluates_the_newest_weights_in_one_task():
    """Device buckets step exactly under the lagged step ([Note: device steps are exact]): the evaluation reads
    them as plain PyTorch has them."""
    engine, optimizer = _engine(["cpu"], "device", lagged=True)
    try:
        assert _one_stage(engine.evaluation_schedule(2))
        _train(engine, optimizer)
        x, mask, _ = batch(rows=5, seed=7)
        with torch.no_grad():
            ours = engine(x, mask)
        torch.testing.assert_close(ours, _plain_outputs(x, mask), rtol=1e-12, atol=1e-12)
    finally:
        engine.close()


def test_stages_are_kept_wherever_weights_cross_or_work_spreads():
    cases = {
        "host placement (every upload crosses)": dict(devices=["cpu"], placement="host"),
        "two devices (the stages spread over them)": dict(devices=["cpu", "cpu"], placement="device"),
        "a frozen layer (its bucket is the host's)": dict(devices=["cpu"], placement="device", freeze_layer=2),
    }
    for what, kwargs in cases.items():
        engine, optimizer = _engine(**kwargs)
        try:
            _train(engine, optimizer)
            assert [str(t) for t in engine.evaluation_schedule(2)] == \
                [str(t) for t in engine.schedule(2, "forward")], what
            assert len(engine.evaluation_schedule(2)) > 1, what
        finally:
            engine.close()


def test_a_forward_kept_for_a_backward_keeps_the_stages(tmp_path):
    """`model(...)` with gradients saves its inputs for the backward's stages: it runs the partition's."""
    path = tmp_path / "trace.json"
    engine, optimizer = _engine(["cpu"], "device", trace_path=str(path))
    try:
        _train(engine, optimizer)
        x, mask, y = batch(rows=8, seed=5)
        expected = [str(t) for t in engine.schedule(2, "forward")]
        nn.functional.cross_entropy(engine(x, mask), y).backward()
    finally:
        engine.close()
    tasks = _traced_tasks(path)
    backward = 9  # its backward: one task per backward stage, B8 to B0
    assert tasks[-len(expected) - backward:-backward] == expected, tasks
    assert not any(t.startswith("F0:L0-8") for t in tasks), tasks
