"""benchmarks/engine_build.py: both variants timed in turns, the record written, and the store's allocator as it
was afterwards (the benchmark's zeroed-flats baseline never outlives its run)."""

from __future__ import annotations

import json

import torch

from accelerate_roundpipe.runtime.state import host_store
from benchmarks import engine_build


def test_both_variants_are_timed_and_the_default_is_restored(tmp_path):
    default = host_store.uninitialized
    out = tmp_path / "build.jsonl"
    record = engine_build.main(["--preset", "cpu-small", "--runs", "2", "--devices", "cpu", "--out", str(out)])
    assert host_store.uninitialized is default
    assert set(record["seconds"]) == {"filled-once", "zeroed-flats"}
    assert all(len(v) == 2 and all(s > 0 for s in v) for v in record["seconds"].values())
    assert json.loads(out.read_text().splitlines()[-1])["median_s"] == record["median_s"]
    assert torch.equal(engine_build.VARIANTS["zeroed-flats"](4, torch.float32), torch.zeros(4))
