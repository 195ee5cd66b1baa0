"""The timeline trace of a CPU run: valid Chrome JSON, one track per worker plus the optimizer, every task."""

from __future__ import annotations

import json

import torch
from torch import nn

from accelerate_roundpipe import RoundPipe, RoundPipeConfig

from toy_models import batch, tied_model


def test_trace_holds_every_task_of_the_schedule(tmp_path):
    path = tmp_path / "trace.json"
    engine = RoundPipe(tied_model(), RoundPipeConfig(devices=["cpu"] * 3, num_microbatches=4, trace_path=str(path)))
    optimizer = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-3))
    expected = []
    for k in range(2):
        expected += [str(t) for t in engine.schedule(4)]
        x, mask, y = batch(rows=8, seed=k)
        engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy)
        optimizer.step()
        optimizer.zero_grad()
    engine.close()
    trace = json.loads(path.read_text())
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert {"d0(cpu) host", "d1(cpu) host", "d2(cpu) host", "optimizer"} <= set(names.values())
    tasks = [e for e in trace["traceEvents"] if e["ph"] == "X" and names[e["tid"]].endswith(" host")]
    assert sorted(e["name"] for e in tasks) == sorted(expected)
    for event in tasks:  # each task on the track of the device the schedule gave it
        assert names[event["tid"]].startswith(f"d{event['name'].rsplit('@d', 1)[1]}(")
    assert all(e["dur"] >= 0 for e in trace["traceEvents"] if e["ph"] == "X")


def test_no_recorder_when_off():
    engine = RoundPipe(tied_model(), RoundPipeConfig(devices=["cpu"]))
    assert engine.trace is None
    engine.close()
