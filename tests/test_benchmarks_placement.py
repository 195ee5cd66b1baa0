"""The benchmark command line passes any RoundPipeConfig field through (`--roundpipe FIELD=VALUE`), and its records
say where the optimizer state lived (the setting and what the engine placed); `call_summary.py` reads them back."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from accelerate_roundpipe.runtime.execution import measured_plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import call_summary, run  # noqa: E402


def _records(out: Path, *flags: str) -> list[dict]:
    run.main(["--workload", "tiny-llama-full-s16-b4", "--nms", "2", "--warm", "1", "--iters", "2", "--devices", "cpu",
              "--out", str(out), *flags])
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_placement_passes_through_and_is_recorded(tmp_path, monkeypatch):
    monkeypatch.delenv("ROUNDPIPE_OPTIMIZER_PLACEMENT", raising=False)
    monkeypatch.delenv("ROUNDPIPE_ASYNC_OPTIMIZER", raising=False)
    out = tmp_path / "ours.jsonl"
    for placement in ("device", "host", "auto"):
        _records(out, "--system", "roundpipe-engine", "--roundpipe", f"optimizer_placement={placement}")
    device, host, auto = _records(out, "--system", "roundpipe-engine", "--roundpipe", "wait_timeout_s=300")[:3]
    assert all(r["status"] == "ok" for r in (device, host, auto))
    assert device["system"] == "roundpipe-engine-sync-optimizer-placement-device"
    assert device["settings"]["optimizer_placement"] == "device"
    assert device["settings"]["config"]["optimizer_placement"] == "device"
    placed = device["settings"]["path"]["optimizer_placement"]
    assert placed["device_buckets"] > 0 and placed["host_buckets"] == 0
    # host is how every earlier record stepped: no suffix; auto on CPU workers keeps the host (the engine's rule)
    assert host["system"] == auto["system"] == "roundpipe-engine-sync-optimizer"
    assert host["settings"]["path"]["optimizer_placement"]["device_buckets"] == 0
    assert auto["settings"]["path"]["optimizer_placement"]["device_buckets"] == 0
    # the same initial weights in every run: the placements' losses compare step by step
    assert device["losses"] == pytest.approx(host["losses"], abs=1e-4)
    # and what the passes kept for recomputation, with the process's resident memory then
    saved = device["settings"]["path"]["saved_inputs"]
    assert saved["lines"][0].startswith("saved inputs: ") and "resident at" in saved["lines"][0]
    assert saved["most_host_bytes"] > 0  # CPU workers keep every saved input in host memory
    # one warm-up step under the measured plan: the record says its first timed step is the new plan's first pass
    assert device["settings"]["first_timed_step_is_first_planned_pass"] is False  # CPU workers: a static plan
    (measured,) = _records(tmp_path / "measured.jsonl", "--system", "roundpipe-engine", "--roundpipe", "plan=measured")
    assert measured["status"] == "ok" and measured["settings"]["first_timed_step_is_first_planned_pass"] is True
    # any other field goes through too
    (other,) = [json.loads(line) for line in out.read_text().splitlines()][3:]
    assert other["settings"]["config"]["wait_timeout_s"] == 300


@pytest.mark.parametrize("data_parallel, system, placed", [
    (False, "roundpipe-engine-sync-optimizer-placement-auto", "auto"),
    (True, "roundpipe-engine-sync-optimizer", "host")])
def test_the_record_says_what_the_engine_placed(tmp_path, monkeypatch, data_parallel, system, placed):
    """"auto" on GPU workers places buckets on them, except under data parallelism, where the engine keeps the host.
    The same config gives both records here: the engine's placement sees the CPU workers as GPUs and is told the run
    is data-parallel or not, so only what the engine decided can tell the two names apart."""
    monkeypatch.delenv("ROUNDPIPE_OPTIMIZER_PLACEMENT", raising=False)
    monkeypatch.delenv("ROUNDPIPE_ASYNC_OPTIMIZER", raising=False)
    place = measured_plan.place_optimizer_state

    def as_on_gpus(setting, budget_gib, devices, store, optimizer, _data_parallel, memory_budget_bytes):
        gpus = [SimpleNamespace(device=d.device, is_cuda=True) for d in devices]
        return place(setting, budget_gib, gpus, store, optimizer, data_parallel, memory_budget_bytes)

    monkeypatch.setattr(measured_plan, "place_optimizer_state", as_on_gpus)
    (record,) = _records(tmp_path / "ours.jsonl", "--system", "roundpipe-engine", "--roundpipe",
                         "optimizer_placement=auto")
    assert record["status"] == "ok"
    assert record["system"] == system
    assert record["settings"]["optimizer_placement"] == placed
    engine_said = record["settings"]["path"]["optimizer_placement"]
    assert engine_said["setting"] == "auto" and engine_said["placed"] == placed
    if data_parallel:
        assert engine_said["device_buckets"] == 0
        assert "data parallelism exchanges gradients on the host" in engine_said["summary"]
    else:
        assert engine_said["device_buckets"] > 0 and engine_said["host_buckets"] == 0


def test_a_device_placement_with_no_room_is_named_host(tmp_path, monkeypatch):
    """"device" with a device budget nothing fits in: every bucket stays on the host, and the record says so."""
    monkeypatch.delenv("ROUNDPIPE_ASYNC_OPTIMIZER", raising=False)
    (record,) = _records(tmp_path / "ours.jsonl", "--system", "roundpipe-engine", "--roundpipe",
                         "optimizer_placement=device", "--roundpipe", "optimizer_device_budget=1e-9")
    assert record["status"] == "ok" and record["system"] == "roundpipe-engine-sync-optimizer"
    assert record["settings"]["optimizer_placement"] == "host"
    engine_said = record["settings"]["path"]["optimizer_placement"]
    assert engine_said["setting"] == "device" and engine_said["device_buckets"] == 0


def test_a_failed_run_is_named_by_the_setting_it_asked_for(tmp_path, monkeypatch):
    """No engine placed anything: the name falls back on the config's setting."""
    monkeypatch.delenv("ROUNDPIPE_ASYNC_OPTIMIZER", raising=False)

    def fails(*args, **kwargs):
        raise RuntimeError("before any optimizer was wrapped")

    monkeypatch.setitem(run.RUNNERS, "roundpipe-engine", fails)
    (record,) = _records(tmp_path / "ours.jsonl", "--system", "roundpipe-engine", "--roundpipe",
                         "optimizer_placement=device")
    assert record["status"] == "ERROR" and record["system"] == "roundpipe-engine-sync-optimizer-placement-device"
    assert record["settings"]["optimizer_placement"] == "device"


@pytest.mark.parametrize("item, message", [("optimizer_placment=host", "did you mean optimizer_placement"),
                                           ("devices=cpu", "give devices with --devices"),
                                           ("optimizer_placement", "expected FIELD=VALUE")])
def test_passthrough_refuses_before_running(tmp_path, capsys, item, message):
    with pytest.raises(SystemExit):
        run.main(["--workload", "tiny-llama-full-s16-b4", "--system", "roundpipe-engine", "--roundpipe", item,
                  "--out", str(tmp_path / "x.jsonl")])
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x.jsonl").exists()


def test_summary_divides_by_the_same_files_baseline(tmp_path):
    ours = {"workload": "qwen3-1.7b-full-s4096-b8", "system": "roundpipe-trainer-sync-optimizer-clip1-placement-auto",
            "tokens_per_s": 40000.0, "status": "ok", "losses": [10.5], "host_peak_gib": 12.0,
            "settings": {"optimizer_placement": "auto", "optimizer_step": "sync", "max_grad_norm": 1.0,
                         "logging_steps": 10, "path": {"optimizer_placement": {
                             "device_buckets": 29, "host_buckets": 0, "device_gib": 25.4}}}}
    anchor = {"section": "placement-liger", "method": "in-GPU bf16 +liger", "model": "qwen3-1.7b", "seq": 4096,
              "global_batch": 8, "tokens_per_s_median": 32000.0, "status": "ok"}
    plain = {"regime": "scratch", "system": "hf", "tokens_per_s": 100000.0, "final_eval_loss": 3.74, "settings": {}}
    auto = {"regime": "scratch", "system": "auto", "tokens_per_s": 95000.0, "final_eval_loss": 3.74,
            "settings": {"optimizer_mode": "sync (exact)", "roundpipe": {"optimizer_placement": "auto"}}}
    files = []
    for name, records in (("ours", [ours]), ("results", [anchor]), ("convergence", [plain, auto])):
        files.append(tmp_path / f"{name}.jsonl")
        files[-1].write_text("".join(json.dumps(r) + "\n" for r in records))
    lines = call_summary.main([str(f) for f in files] + [str(tmp_path / "missing.jsonl")])
    (trainer,) = [line for line in lines if "placement-auto" in line]
    assert "1.250x in-gpu-liger" in trainer and "auto (29/29 buckets, 25.4 GiB on device)" in trainer
    assert "host 12.0 GiB" in trainer and "loss 10.5000" in trainer
    (rp,) = [line for line in lines if line.startswith("scratch  auto")]
    assert "0.950x hf" in rp and "held-out 3.7400" in rp and "placement auto" in rp


def test_summary_counts_the_disks_buckets_in_the_total():
    """A disk run's record counts its disk buckets apart from `host_buckets` (those whose state stays in host memory);
    the summary once printed '4/4 buckets' for a run with 34 more on disk (the 4B at 64 x 4096, 2026-12-07)."""
    placed = {"device_buckets": 4, "host_buckets": 0, "device_gib": 11.005,
              "disk": {"buckets": 34, "gib": 38.352, "host_budget_gib": 24.0}}
    text = call_summary._placement({"optimizer_placement": "auto+disk", "path": {"optimizer_placement": placed}})
    assert text == "auto+disk (4/38 buckets, 11.0 GiB on device; 34 on disk, 38.4 GiB)"
    without_disk = dict(placed, host_buckets=34, disk=None)
    text = call_summary._placement({"optimizer_placement": "auto", "path": {"optimizer_placement": without_disk}})
    assert text == "auto (4/38 buckets, 11.0 GiB on device)"
