"""Our three ways in (`benchmarks/runners/`) on a tiny model (CPU), and the command line that runs a workload
(`benchmarks/run.py`), whose record `benchmarks/collect.py` reads back."""

from __future__ import annotations

import copy
import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import collect, run  # noqa: E402
from benchmarks.models import make_batch  # noqa: E402
from benchmarks.runners import RUNNERS, common  # noqa: E402


def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64, max_position_embeddings=64, use_cache=False)
    return LlamaForCausalLM(config)


def test_three_paths_same_losses(monkeypatch):
    from accelerate_roundpipe import RoundPipeConfig

    closed = []
    close = common.close_engine
    monkeypatch.setattr(common, "close_engine", lambda engine: (close(engine), closed.append(engine)))
    model = tiny_model()
    batch = make_batch(64, rows=4, seq=16)
    results = {}
    for name, runner in RUNNERS.items():
        config = RoundPipeConfig(devices=["cpu"], num_microbatches=2)
        results[name] = runner(copy.deepcopy(model), config, batch, 1, 2, 1e-3)
    for name, result in results.items():
        assert len(result["losses"]) == 3 and all(math.isfinite(v) for v in result["losses"]), name
        assert result["iter_s"] > 0 and result["tokens_per_s"] == pytest.approx(4 * 16 / result["iter_s"], rel=1e-3)
        assert result["num_microbatches"] == 2 and len(result["step_s"]) == 3
        assert "fused=True" in result["path"]["optimizer"] and "weight_decay=0.0" in result["path"]["optimizer"]
    engine, loop, trainer = (results[n]["losses"] for n in RUNNERS)
    # Same rows, same initial weights, same fused pass: the engine and the Accelerate loop return the same float.
    assert loop[0] == engine[0]
    # The Trainer's loss comes from its logs (`logs["loss"]`): the same float with the transformers tested here (its
    # `num_items_in_batch` counts the labels after the shift, as the engine does), but older Trainers round logged
    # losses to 4 decimals; hence the tolerance.
    assert trainer[0] == pytest.approx(engine[0], abs=5e-5)
    # Later steps too (same optimizer, lr, staleness on every path).
    assert loop == pytest.approx(engine, abs=1e-6) and trainer == pytest.approx(engine, abs=5e-5)
    # Each path closed its engine (its threads stopped), the Trainer's included.
    assert len(closed) == len(RUNNERS) and all(e is not None and e._failure.closed for e in closed)


def test_command_line_record_reads_back(tmp_path, monkeypatch):
    monkeypatch.setenv("ROUNDPIPE_ASYNC_OPTIMIZER", "true")  # the system name without a variant suffix
    out = tmp_path / "ours.jsonl"
    run.main(["--workload", "tiny-llama-full-s16-b4", "--system", "roundpipe-engine", "--nms", "2", "--warm", "1",
              "--iters", "1", "--devices", "cpu", "--out", str(out)])
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["status"] == "ok" and record["tokens_per_s"] > 0 and record["settings"]["num_microbatches"] == 2
    (collected,) = collect.collect([str(out)], "cpu", "2026-12-01")
    assert collected["workload"] == "tiny-llama-full-s16-b4" and collected["system"] == "roundpipe-engine"
    assert collected["tokens_per_s"] == record["tokens_per_s"] and collected["max_seq"] is None


def _one_record(tmp_path, *flags: str) -> dict:
    out = tmp_path / "ours.jsonl"
    run.main(["--workload", "tiny-llama-full-s16-b4", "--nms", "2", "--warm", "1", "--iters", "1", "--devices", "cpu",
              "--out", str(out), *flags])
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["status"] == "ok", record
    return record


def test_records_state_optimizer_clipping_and_logging(tmp_path, monkeypatch):
    monkeypatch.setenv("ROUNDPIPE_ASYNC_OPTIMIZER", "true")
    engine = _one_record(tmp_path / "engine", "--system", "roundpipe-engine")
    assert engine["system"] == "roundpipe-engine"
    assert {k: engine["settings"][k] for k in ("optimizer_step", "max_grad_norm", "logging_steps")} == {
        "optimizer_step": "async", "max_grad_norm": 0.0, "logging_steps": 1}
    trainer = _one_record(tmp_path / "trainer", "--system", "roundpipe-trainer", "--max-grad-norm", "1.0",
                          "--logging-steps", "10")
    assert trainer["system"] == "roundpipe-trainer-clip1"
    assert trainer["settings"]["max_grad_norm"] == 1.0 and trainer["settings"]["logging_steps"] == 10
    assert trainer["settings"]["path"]["max_grad_norm"] == 1.0
    monkeypatch.setenv("ROUNDPIPE_ASYNC_OPTIMIZER", "false")  # the environment chooses, as for a user
    loop = _one_record(tmp_path / "loop", "--system", "roundpipe-accelerate-loop")
    assert loop["system"] == "roundpipe-accelerate-loop-sync-optimizer"
    assert loop["settings"]["optimizer_step"] == "sync" and loop["settings"]["config"]["async_optimizer"] is False


def test_only_the_trainer_clips(tmp_path):
    with pytest.raises(SystemExit):
        run.main(["--workload", "tiny-llama-full-s16-b4", "--system", "roundpipe-engine", "--max-grad-norm", "1",
                  "--out", str(tmp_path / "x.jsonl")])


def test_the_record_says_the_micro_batches_a_sized_first_pass_ran():
    """Without `num_microbatches` the passes run the count that fits the batch ([Note: first-pass micro-batches]);
    the record must say that count, not the default the engine would give a batch of unknown length."""
    from accelerate_roundpipe import RoundPipeConfig, wrap_model
    from accelerate_roundpipe.plan.activation_estimate import row_activations
    from accelerate_roundpipe.runtime.execution.measured_plan import PLAN_SHARE

    model = tiny_model()
    model.config._attn_implementation = "eager"  # the scores term: a row's transient grows with seq^2
    rows, seq = 4, 16
    probe = wrap_model(copy.deepcopy(model), RoundPipeConfig(devices=["cpu"], summary=False))
    try:
        stage_bytes = probe._microbatches.sizer.stage_bytes
    finally:
        probe.close()
    per_row = row_activations(model.config, seq, torch.float32.itemsize).total_bytes
    budget_gib = (stage_bytes + 1.5 * per_row) / PLAN_SHARE / 2**30  # one row fits, two do not
    config = RoundPipeConfig(devices=["cpu"], gpu_memory_budget=budget_gib)
    result = RUNNERS["roundpipe-engine"](model, config, make_batch(64, rows=rows, seq=seq), 1, 1, 1e-3)
    assert result["num_microbatches"] == rows


def test_engine_accumulation_equals_one_call_over_the_batch():
    """`accumulation` N: N calls of rows/N each, gradients scaled by 1/N, one step: the same losses as one call over
    every row (float64: the mean over equal slices is the batch's mean), and the engine planned one call's rows."""
    from accelerate_roundpipe import RoundPipeConfig

    batch = make_batch(64, rows=4, seq=16)
    results = {}
    for accumulation in (1, 2):
        model = tiny_model().double()
        config = RoundPipeConfig(devices=["cpu"], num_microbatches=1)
        results[accumulation] = RUNNERS["roundpipe-engine"](model, config, batch, warm=0, iters=3, lr=1e-2,
                                                            accumulation=accumulation)
    assert results[2]["path"]["accumulation"] == 2
    assert results[2]["losses"] == pytest.approx(results[1]["losses"], rel=1e-10)
    assert results[2]["losses"][2] < results[2]["losses"][0]  # it trained: the step saw the accumulated gradients
    with pytest.raises(ValueError, match="divide the batch's 4 rows"):
        RUNNERS["roundpipe-engine"](tiny_model(), RoundPipeConfig(devices=["cpu"]), batch, 0, 1, accumulation=3)


def test_an_accumulating_workload_refuses_another_runner_before_anything_is_built(tmp_path):
    with pytest.raises(SystemExit, match="only --system roundpipe-engine runs accumulation"):
        run.main(["--workload", "qwen3-4b-full-s4096-b64-cap24", "--system", "roundpipe-trainer",
                  "--out", str(tmp_path / "ours.jsonl")])
    assert not (tmp_path / "ours.jsonl").exists()
