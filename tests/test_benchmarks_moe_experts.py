"""`benchmarks/moe_experts.py --tiny` runs end to end on CPU workers: one record per part and experts
implementation, each of which ran only the implementation it names (counted at transformers' dispatch: for the
engine, on its layer copies after `set_experts_implementation` on the model), the same loss for all (lr 0: the same
weights), and transformers' dispatch left as it was."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("peft")
moe = pytest.importorskip("transformers.integrations.moe")


def test_the_tiny_run_records_every_part_and_implementation(tmp_path, monkeypatch):
    from benchmarks import moe_experts

    monkeypatch.setenv("ROUNDPIPE_SUMMARY", "0")
    out = tmp_path / "records.jsonl"
    moe_experts.main(["--tiny", "--warm", "1", "--iters", "1", "--out", str(out)])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    parts = [(r["part"], r["experts_implementation"]) for r in records]
    implementations = list(moe_experts.IMPLEMENTATIONS)
    assert parts == [("hf", n) for n in implementations] + [("peft-in-gpu", "grouped_mm")] + \
        [("engine", "grouped_mm"), ("engine-peft-merged", "grouped_mm")] + [("engine", n) for n in implementations]
    layers, steps = moe_experts.TINY["num_hidden_layers"], 2
    for record in records:
        assert record["tokens_per_s"] > 0 and len(record["losses"]) == steps
        # plain HF: one call a layer and step; the engine: micro-batches x (forward, recomputation)
        per_step = layers * (2 * 2 if record["part"].startswith("engine") else 1)
        assert record["ran"] == {record["experts_implementation"]: per_step * steps}, record
    losses = {round(loss, 4) for r in records for loss in r["losses"]}
    assert len(losses) == 1, losses
    assert "get_interface" not in vars(moe.ALL_EXPERTS_FUNCTIONS)


def test_the_layer_profile_sorts_kernels_by_kind_and_runs_tiny(tmp_path, monkeypatch):
    from benchmarks import moe_layer_profile as profile

    assert profile.kind_of("void cutlass::device_kernel<grouped_gemm ...>") == "experts grouped GEMM"
    assert profile.kind_of("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT") == "GEMM"
    assert profile.kind_of("cudnn_generated_fort_native_sdpa_sm90_flash_fprop") == "attention"
    assert profile.kind_of("void at::native::radixSortKVInPlace<...>") == "routing (sort, index, scatter, histogram)"
    assert profile.kind_of("void at::native::vectorized_elementwise_kernel<8, CUDAFunctor_add>") == "elementwise"
    assert profile.kind_of("mystery") == "other"
    monkeypatch.setenv("ROUNDPIPE_SUMMARY", "0")
    out = tmp_path / "records.jsonl"
    profile.main(["--tiny", "--batch", "2", "--seq", "8", "--warm", "1", "--steps", "1", "--out", str(out)])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["system"].split()[0] for r in records] == ["hf", "peft", "engine"]
    losses = {round(r["losses"][0], 4) for r in records}
    assert len(losses) == 1 and all(r["wall_ms"] > 0 for r in records), records
