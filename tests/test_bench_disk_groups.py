"""The disk tier's benchmark groups of `scripts/device/bench.sh` (disk-cap24, disk-cap24-host, disk-8b), without a
GPU: what each would run, checked by `benchmarks/run.py`'s own parser; and what a record says of the disk tier (its
tiers, the disk's probe, the system's name), from a CPU engine."""

from __future__ import annotations

import re

import torch
from test_bench_script_groups import bench

from accelerate_roundpipe import RoundPipe, RoundPipeConfig
from benchmarks import run
from benchmarks.runners import common
from benchmarks.workloads import WORKLOADS

from toy_models import tied_model

GROUPS = {  # group: [(workload, --roundpipe fields, limit)]
    "disk-cap24": [("qwen3-4b-full-s4096-b8-cap24", {"host_memory_budget": "24"}, 330),
                   ("qwen3-4b-full-s4096-b8-cap24", {}, 150)],
    "disk-cap24-host": [("qwen3-4b-full-s4096-b8-cap24",
                         {"host_memory_budget": "24", "optimizer_placement": "host"}, 330),
                        ("qwen3-4b-full-s4096-b8-cap24", {"optimizer_placement": "host"}, 150)],
    "disk-8b": [("llama3.1-8b-full-s4096-b8", {"host_memory_budget": "96"}, 540)],
    "disk-8b-cap24": [("llama3.1-8b-full-s4096-b8-cap24", {"host_memory_budget": "96"}, 560)],
    "disk-cap24-b64": [("qwen3-4b-full-s4096-b64-cap24", {"host_memory_budget": "24"}, 320),
                       ("qwen3-4b-full-s4096-b64-cap24", {}, 250)],
    "disk-cap24-b64-short": [("qwen3-4b-full-s4096-b64-cap24", {}, 170),
                             ("qwen3-4b-full-s4096-b64-cap24", {"host_memory_budget": "24"}, 300)],
    "disk-cap24-b64-lagged": [("qwen3-4b-full-s4096-b64-cap24", {"host_memory_budget": "24"}, 320)],
    "disk-8b-cap24-b64": [("llama3.1-8b-full-s4096-b64-cap24", {"host_memory_budget": "96"}, 560)],
}


def test_each_disk_group_runs_the_engine_with_its_budget_and_the_disk_probe(tmp_path):
    for group, runs in GROUPS.items():
        done, calls, log = bench(tmp_path / group, group)
        assert done.returncode == 0, done.stderr
        ours = [c for c in calls if c.startswith("benchmarks/run.py ")]
        assert len(ours) == len(runs), (group, calls)
        for call, (workload, fields, _) in zip(ours, runs):
            args = run.parse_args(call.split()[1:])
            assert (args.workload, args.system, args.nms, args.disk_probe) == (
                workload, "roundpipe-engine", "auto", True)
            assert args.roundpipe == fields
            assert not args.max_grad_norm and "async_optimizer" not in fields  # the exact step, no clip
        limits = [int(m) for m in re.findall(r"^=== \[\d+ s\] (\d+) python3 benchmarks/run.py", log, re.M)]
        assert limits == [limit for _, _, limit in runs]
        assert sum(limits) <= 585  # one device call
    assert WORKLOADS["llama3.1-8b-full-s4096-b8"].lora is False
    assert WORKLOADS["llama3.1-8b-full-s4096-b8"].cap_gib == 0.0
    assert WORKLOADS["llama3.1-8b-full-s4096-b8-cap24"].cap_gib == 24.0
    for name in ("qwen3-4b-full-s4096-b64-cap24", "llama3.1-8b-full-s4096-b64-cap24"):  # issue 33: accumulation
        assert (WORKLOADS[name].global_batch, WORKLOADS[name].accumulation) == (64, 8)


def test_a_records_placement_names_the_disk_and_its_bandwidth(tmp_path):
    config = RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=2, summary=False, host_memory_budget=1e-9,
                             offload_dir=str(tmp_path))
    engine = RoundPipe(tied_model(), config)
    try:
        engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-3))
        placed = common.placement_of(engine)
        assert placed["placed"] == "disk" and placed["disk"]["buckets"] == len(engine.host_store.trainable_buckets)
        assert placed["disk"]["disk_read_gbps"] > 0 and placed["disk"]["disk_write_gbps"] > 0
        assert "disk" in placed["disk"]["tiers"]
        probe = run.disk_probe(config, {"optimizer_placement": placed})
        assert probe["measured_by"] == "the engine's start" and probe["disk_read_gbps"] == placed["disk"][
            "disk_read_gbps"]
        assert run.system_name("roundpipe-engine", False, 0.0, placed["placed"]) == \
            "roundpipe-engine-sync-optimizer-placement-disk"
    finally:
        engine.close()
    host = RoundPipeConfig(devices=["cpu"], offload_dir=str(tmp_path / "probe"))
    probe = run.disk_probe(host, {"optimizer_placement": {"placed": "host"}})  # no disk tier: measured by the run
    assert probe["measured_by"] == "benchmarks/run.py" and probe["disk_read_gbps"] > 0
