"""`benchmarks/dense_layer_profile.py` runs on the CPU with tiny shapes: every system's record, the same loss (lr 0,
the same weights and batch), and the engine with one layer a backward stage plans those stages."""

from __future__ import annotations

import json


def test_the_dense_layer_profile_runs_tiny_and_every_system_computes_the_same_loss(tmp_path, monkeypatch):
    from benchmarks import dense_layer_profile as profile

    monkeypatch.setenv("ROUNDPIPE_SUMMARY", "0")
    out = tmp_path / "records.jsonl"
    profile.main(["--tiny", "--layers", "2", "--warm", "1", "--steps", "1", "--out", str(out)])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["system"] for r in records] == list(profile.SYSTEMS)
    losses = [r["losses"][0] for r in records]
    assert max(losses) - min(losses) < 1e-4, losses
    assert all(r["wall_ms"] > 0 and r["layers"] == 2 for r in records), records
    by_system = {r["system"]: r for r in records}
    assert by_system["engine"]["partition"].startswith("forward ["), by_system["engine"]  # its own plan (GPU: measured)
    assert by_system["engine-stages"]["partition"] == \
        "forward [L0-2] fused [L3-3] backward [L0-0 L1-1 L2-2]", by_system["engine-stages"]


def test_the_lora_profile_trains_the_adapters_in_every_system(tmp_path, monkeypatch):
    from benchmarks import dense_layer_profile as profile

    monkeypatch.setenv("ROUNDPIPE_SUMMARY", "0")
    out = tmp_path / "records.jsonl"
    profile.main(["--tiny", "--lora", "--layers", "2", "--warm", "1", "--steps", "1", "--out", str(out)])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["system"] for r in records] == list(profile.SYSTEMS)
    assert all(r["training"] == "lora r16" for r in records)
    losses = [r["losses"][0] for r in records]
    assert max(losses) - min(losses) < 1e-4, losses


def test_unknown_systems_are_refused_by_name(capsys):
    import pytest

    from benchmarks import dense_layer_profile as profile

    with pytest.raises(SystemExit):
        profile.main(["--tiny", "--systems", "hf,engine"])
    assert "unknown ['hf']" in capsys.readouterr().err
