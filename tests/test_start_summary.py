"""The engine's start summary (one block on stderr at the first pass) and where its trace is written, on every way
in that builds an engine; `ROUNDPIPE_SUMMARY=0` silences both."""

from __future__ import annotations

import os
from unittest import mock

import torch
from torch import nn

from accelerate_roundpipe import RoundPipe, RoundPipeConfig
from accelerate_roundpipe.telemetry.summary import PREFIX

from toy_models import batch, tied_model


def _train(engine, optimizer, passes: int = 2) -> None:
    for k in range(passes):
        x, mask, y = batch(rows=8, seed=k)
        engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy)
        optimizer.step()
        optimizer.zero_grad()


def test_summary_once_at_the_first_pass_says_how_the_engine_runs(capsys, tmp_path):
    trace = str(tmp_path / "trace.json")
    engine = RoundPipe(
        tied_model(),
        RoundPipeConfig(
            devices=["cpu", "cpu"], num_microbatches=4, recompute="layer", async_optimizer=True, trace_path=trace
        ),
    )
    optimizer = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-3))
    engine.summary_notes["clipping"] = "max_grad_norm=1 (a note an integration adds)"
    assert capsys.readouterr().err == ""  # nothing before the first pass: the optimizer is not known until then
    _train(engine, optimizer)
    err = capsys.readouterr().err
    assert err.count("RoundPipe is on") == 1  # once per engine, not per pass
    lines = [line.removeprefix(PREFIX) for line in err.splitlines()]
    expected = [
        f"RoundPipe is on: 2 worker(s) (cpu, cpu), {len(engine.layers)} pipeline layers",
        f"  plan: static, {engine.partition}",
        "  micro-batches: 4 per pass (num_microbatches), all in one round; recompute: layer",
        "  optimizer: AdamW, lagged one step (async, staleness 1)",
        f"  optimizer state: auto: all {len(engine.host_store.trainable_buckets)} trainable buckets on the host "
        "(CPU workers gain nothing from it; optimizer_placement=device places it anyway)",
        "  clipping: max_grad_norm=1 (a note an integration adds)",
    ]
    assert lines[: len(expected)] == expected
    store_mib = engine.host_store.estimated_bytes / 2**20
    assert f"  host memory: about {store_mib:.1f} MiB for the store (compute float64, optimizer float64" in err
    assert "pinned: no" in err and f"  trace: {trace} (written at the end of training and at exit)" in err
    engine.close()
    assert f"trace written to {trace}" in capsys.readouterr().err


def test_host_memory_estimate_counts_every_copy_and_adam_state():
    """The summary's estimate: compute copy + optimizer copy + gradient + two AdamW states (no spare gradient
    buffer: [Note: no spare gradient buffer])."""
    model = tied_model()
    numel = sum(p.numel() for p in model.parameters())
    engine = RoundPipe(model, RoundPipeConfig(devices=["cpu"]))
    assert engine.host_store.estimated_bytes == numel * 8 * (1 + 2 + 2)  # float64 everywhere
    engine.close()


def test_exact_step_and_default_microbatches_are_named(capsys):
    engine = RoundPipe(tied_model(), RoundPipeConfig(devices=["cpu", "cpu"]))
    _train(engine, engine.wrap_optimizer(torch.optim.SGD(engine.parameters(), lr=0.1)), passes=1)
    err = capsys.readouterr().err
    assert "micro-batches: 4 per pass (2 x devices; num_microbatches to change it)" in err
    assert "optimizer: SGD, exact step (sync; async_optimizer=true for the lagged one)" in err
    assert "trace: off (ROUNDPIPE_TRACE=path.json records one)" in err
    engine.close()


def test_summary_env_variable_silences_summary_and_trace_lines(capsys, tmp_path):
    with mock.patch.dict(os.environ, {"ROUNDPIPE_SUMMARY": "0"}):
        config = RoundPipeConfig(devices=["cpu"], trace_path=str(tmp_path / "t.json"))
    assert config.summary is False and RoundPipeConfig(devices=["cpu"]).resolved_summary is True
    engine = RoundPipe(tied_model(), config)
    _train(engine, engine.wrap_optimizer(torch.optim.SGD(engine.parameters(), lr=0.1)), passes=1)
    engine.close()
    assert capsys.readouterr().err == "" and (tmp_path / "t.json").is_file()
