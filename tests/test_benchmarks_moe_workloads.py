"""The mixture-of-experts LoRA workloads through `benchmarks/run.py` on CPU workers: tiny Qwen3-MoE (LoRA on the
usual target modules, which PEFT maps onto the fused experts) and tiny GPT-OSS (LoRA on the experts'
`target_parameters` and the attention), each a record with its settings, every step's loss and the model FLOPs of
the active experts; the big workloads are the same code with the published configs."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import run  # noqa: E402
from benchmarks.flops import lora_params, matmul_params, workload_flops_per_token  # noqa: E402
from benchmarks.workloads import SHAPES, WORKLOADS  # noqa: E402


def record_of(tmp_path, workload: str, system: str, *flags: str) -> dict:
    out = tmp_path / f"{system}.jsonl"
    run.main(["--workload", workload, "--system", system, "--nms", "2", "--warm", "1", "--iters", "2", "--devices",
              "cpu", "--lr", "1e-3", "--out", str(out), *flags])
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    return record


@pytest.mark.parametrize("workload", ["tiny-qwen3-moe-lora-s16-b4", "tiny-gpt-oss-lora-s16-b4"])
def test_moe_lora_workload_runs_on_the_engine(tmp_path, workload):
    w = WORKLOADS[workload]
    record = record_of(tmp_path, workload, "roundpipe-engine")
    assert record["status"] == "ok", record.get("error")
    assert record["system"] == "roundpipe-engine-sync-optimizer"  # the engine's default: the exact step
    settings = record["settings"]
    assert settings["lora"] is True and settings["num_microbatches"] == 2 and settings["optimizer_step"] == "sync"
    assert len(record["losses"]) == 3 and all(math.isfinite(v) for v in record["losses"])
    assert record["losses"][2] < record["losses"][0]  # lr 1e-3 on the same rows: the adapters train
    shape = SHAPES[w.arch]
    # every adapter PEFT made, the experts' included (the attention's alone would be far fewer)
    assert settings["trainable_params"] == lora_params(shape, active_only=False)
    assert settings["trainable_params"] > 2 * lora_params(shape)  # more experts stored than a token runs
    assert settings["lora_targets"]["target_parameters"] or "gate_proj" in settings["lora_targets"]["target_modules"]
    assert record["flops_per_token"] == workload_flops_per_token(shape, 16, True)
    assert matmul_params(shape) < matmul_params(shape, active_only=False)
    assert settings["build_s"] >= 0 and settings["build_host_peak_gib"] > 0


def test_moe_lora_same_losses_on_every_way_in(tmp_path):
    # the same initial weights (seed 0) and rows: the engine, the Accelerate loop and the Trainer train alike
    losses = {}
    for system in ("roundpipe-engine", "roundpipe-accelerate-loop", "roundpipe-trainer"):
        flags = ("--logging-steps", "1") if system == "roundpipe-trainer" else ()  # every step's loss logged
        record = record_of(tmp_path, "tiny-qwen3-moe-lora-s16-b4", system, *flags)
        assert record["status"] == "ok", record.get("error")
        losses[system] = record["losses"]
    # the records keep 5 decimals
    assert losses["roundpipe-accelerate-loop"] == pytest.approx(losses["roundpipe-engine"], abs=1e-5)
    assert losses["roundpipe-trainer"] == pytest.approx(losses["roundpipe-engine"], abs=1e-5)


def test_big_moe_workloads_are_named():
    for name, arch in (("qwen3-30b-a3b-lora-s4096-b8-cap24", "qwen3-30b-a3b"),
                       ("gpt-oss-20b-lora-s4096-b8-cap24", "gpt-oss-20b"),
                       ("qwen3-32b-lora-s4096-b8-cap24", "qwen3-32b")):
        w = WORKLOADS[name]
        assert (w.arch, w.seqs, w.global_batch, w.lora, w.cap_gib) == (arch, (4096,), 8, True, 24.0)


def test_cap_lifted_while_building(monkeypatch):
    # the emulated card's cap is off while the model is built on the GPU, and back after, an error included
    import torch

    from benchmarks import models

    fraction = [24 / 141]
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: fraction[0])
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda value, device=None: (fraction.__setitem__(0, value), calls.append(value)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: calls.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    with models.cap_lifted():
        assert fraction[0] == 1.0
    assert fraction[0] == 24 / 141 and calls == [1.0, "synchronize", "empty_cache", 24 / 141]
    with pytest.raises(RuntimeError, match="build failed"), models.cap_lifted():
        raise RuntimeError("build failed")
    assert fraction[0] == 24 / 141
