"""benchmarks/step_bounds.py: busy time, shares, bytes and idle gaps per track on a hand-made trace with known
overlaps, and the same numbers read from a trace a CPU engine run wrote."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from benchmarks import step_bounds

TRACKS = ["d0(cuda:0) compute", "d0(cuda:0) parameter upload", "d0(cuda:0) gradient download", "optimizer",
          "caller"]


def _x(track: str, name: str, start: float, end: float) -> dict:
    return {"ph": "X", "pid": 0, "tid": TRACKS.index(track), "name": name, "ts": start * 1e6,
            "dur": (end - start) * 1e6}


def _trace() -> dict:
    """Two passes of F then B on one GPU. Pass 0 [0, 2]; the optimizer [2, 3]; two uploads of 100 MiB overlapping by
    0.25 s in [3, 4]; pass 1 from 4, its B 0.5 s after its F (a gradient download of 50 MiB in the hole); the last
    optimizer step [6.5, 7.5]; the caller waits [2, 4]."""
    f, b = "F0:L0-0:r0:m0-0@d0", "B0:L0-0:r0:m0-0@d0"
    compute, upload, download = TRACKS[:3]
    events = [{"ph": "M", "pid": 0, "tid": i, "name": "thread_name", "args": {"name": t}} for i, t in enumerate(TRACKS)]
    events += [_x(compute, f, 0, 1), _x(compute, b, 1, 2), _x(compute, f, 4, 5), _x(compute, b, 5.5, 6.5),
               _x(upload, "100.0 MiB", 3.0, 3.5), _x(upload, "100.0 MiB", 3.25, 4.0),
               _x(download, "50.0 MiB", 5.0, 5.5),
               _x("optimizer", "step layers [0]", 2, 3), _x("optimizer", "step layers [0]", 6.5, 7.5),
               _x("caller", "wait for the loss of pass 0", 2, 4)]
    return {"traceEvents": events}


def test_window_of_the_last_steps_or_seconds():
    tracks = step_bounds.track_spans(_trace())
    compute = step_bounds.compute_tracks(tracks)
    assert compute == ["d0(cuda:0) compute"]
    assert step_bounds.pass_starts(tracks, compute) == [0.0, 4.0]
    assert step_bounds.window(tracks, compute) == (4.0, 7.5, 1)  # all but the first pass, to the last span
    assert step_bounds.window(tracks, compute, steps=2) == (0.0, 7.5, 2)
    assert step_bounds.window(tracks, compute, steps=9) == (0.0, 7.5, 2)
    assert step_bounds.window(tracks, compute, seconds=3.0) == (4.0, 7.5, 1)  # tasks starting after 6.5 - 3


def test_busy_share_and_bytes_per_track_count_overlaps_once():
    s = step_bounds.summarize(_trace(), steps=2)
    assert (s["steps"], s["window_s"], s["step_s"], s["devices"]) == (2, 7.5, 3.75, 1)
    rows = s["tracks"]
    assert rows["d0(cuda:0) compute"]["busy_s_per_step"] == pytest.approx(2.0)
    assert rows["d0(cuda:0) compute"]["share"] == pytest.approx(4.0 / 7.5)
    assert rows["d0(cuda:0) parameter upload"]["busy_s_per_step"] == pytest.approx(0.5)  # union 1.0, not 1.25
    assert rows["d0(cuda:0) parameter upload"]["bytes_per_step"] == 100 * 2**20
    assert rows["d0(cuda:0) parameter upload"]["gbps"] == pytest.approx(200 * 2**20 / 1.0 / 1e9)
    assert rows["caller"]["share"] == pytest.approx(2.0 / 7.5) and rows["caller"]["bytes_per_step"] is None
    assert s["upload_bytes_per_step"] == 100 * 2**20 and s["download_bytes_per_step"] == 25 * 2**20
    one = step_bounds.summarize(_trace())  # the last step alone: the uploads before it are not in it
    assert one["tracks"]["d0(cuda:0) compute"]["share"] == pytest.approx(2.0 / 3.5)
    assert one["tracks"]["d0(cuda:0) parameter upload"]["busy_s_per_step"] == 0.0
    assert one["tracks"]["optimizer"]["busy_s_per_step"] == pytest.approx(1.0)


def test_idle_gaps_of_the_compute_track_say_what_the_others_did():
    s = step_bounds.summarize(_trace(), steps=2, least_gap_s=0.1)
    holes = s["compute_gaps"]["d0(cuda:0) compute"]
    assert [(g["at_s"], g["idle_s"]) for g in holes] == [(2.0, 2.0), (5.0, 0.5)]  # longest first
    first = holes[0]["during"]
    assert list(first) == ["caller", "d0(cuda:0) parameter upload", "optimizer"]  # busiest first
    assert first["caller"]["busy_s"] == pytest.approx(2.0)
    assert first["d0(cuda:0) parameter upload"] == {"busy_s": pytest.approx(1.0), "longest": "100.0 MiB"}
    assert first["optimizer"] == {"busy_s": pytest.approx(1.0), "longest": "step layers [0]"}
    assert holes[1]["during"] == {"d0(cuda:0) gradient download": {"busy_s": pytest.approx(0.5),
                                                                   "longest": "50.0 MiB"}}
    assert step_bounds.summarize(_trace(), steps=2, least_gap_s=1.0)["compute_gaps"]["d0(cuda:0) compute"][0][
        "idle_s"] == 2.0
    assert len(step_bounds.summarize(_trace(), steps=2, least_gap_s=0.1, gap_count=1)["compute_gaps"][
        "d0(cuda:0) compute"]) == 1


def test_bounds_beside_the_measured_numbers():
    s = step_bounds.summarize(_trace(), steps=2, flops_per_step=0.5 * 790e12, peak_tflops=790, pcie_gbps=10,
                              host_step_s=0.25)
    b = s["bounds"]
    assert b["compute"] == {"bound_s": pytest.approx(0.5), "share_of_step": pytest.approx(0.5 / 3.75)}
    assert b["pcie"]["bound_s"] == pytest.approx(100 * 2**20 / 10e9)  # the busier direction, from the spans
    assert b["host_step"] == {"bound_s": 0.25, "share_of_step": pytest.approx(0.25 / 3.75)}
    given = step_bounds.summarize(_trace(), steps=2, pcie_bytes_per_step=5e9, pcie_gbps=10)
    assert given["bounds"]["pcie"]["bound_s"] == 0.5 and given["pcie_bytes_source"] == "given"
    assert "compute" not in given["bounds"] and "host_step" not in given["bounds"]
    table = step_bounds.format_table(s)
    assert "d0(cuda:0) compute" in table and "host_step" in table and "at 2.000 s: 2000.0 ms idle" in table


def test_span_bytes_from_copy_and_disk_names():
    assert step_bounds.span_bytes("12.5 MiB") == 12.5 * 2**20
    assert step_bounds.span_bytes("read layer3.bin [4096, 12288)") == 8192
    assert step_bounds.span_bytes("F0:L0-2:r0:m0-3@d0") == 0


def test_main_json_and_workload_flops(tmp_path, capsys):
    from benchmarks.flops import workload_flops_per_token
    from benchmarks.workloads import WORKLOADS

    path = tmp_path / "trace.json"
    path.write_text(json.dumps(_trace()))
    record = step_bounds.main([str(path), "--steps", "2", "--workload", "qwen3-4b-full-s4096-b8-cap24", "--json"])
    assert json.loads(capsys.readouterr().out)["steps"] == 2
    w = WORKLOADS["qwen3-4b-full-s4096-b8-cap24"]
    assert record["tokens_per_step"] == 8 * 4096
    assert record["flops_per_step"] == workload_flops_per_token(w.shape, 4096, False) * 8 * 4096
    assert record["bounds"]["compute"]["bound_s"] == pytest.approx(record["flops_per_step"] / 790e12)
    halved = step_bounds.main([str(path), "--workload", "qwen3-4b-full-s4096-b8-cap24", "--tokens-per-step", "16384"])
    assert halved["flops_per_step"] == record["flops_per_step"] / 2
    assert "longest idle gaps" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        step_bounds.parse_args([str(path), "--tokens-per-step", "5"])


def _timed_cpu_device():
    """A CPU worker that records its copies and compute like a GPU's streams (`records_kernel_time`), each span on
    the host clock: the engine's own copy spans, with their sizes, without a GPU."""
    from accelerate_roundpipe.runtime.devices.cpu_device import CpuDevice

    class TimedCpuDevice(CpuDevice):
        records_kernel_time = True

        def kernel_span(self, stream, track, name):
            span = self.trace.span(f"{self} {track}", name)
            return span.__enter__, lambda: span.__exit__(None, None, None)

    return TimedCpuDevice


def test_a_trace_from_a_cpu_engine_run(tmp_path, monkeypatch):
    from accelerate_roundpipe import RoundPipe, RoundPipeConfig
    from accelerate_roundpipe.runtime.devices import factory

    monkeypatch.setattr(factory, "cpu_device_class", _timed_cpu_device())
    torch.manual_seed(0)
    layers = 6  # 512 x 512 float32 weights: 1.0 MiB a layer
    path = tmp_path / "trace.json"
    engine = RoundPipe(nn.Sequential(*[nn.Linear(512, 512) for _ in range(layers)]),
                       RoundPipeConfig(devices=["cpu"], num_microbatches=2, trace_path=str(path)))
    optimizer = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-3))
    for _ in range(4):
        engine.forward_backward(torch.randn(8, 512), labels=torch.randint(0, 512, (8,)),
                                loss_fn=nn.functional.cross_entropy)
        optimizer.step()
        optimizer.zero_grad()
    engine.close()
    s = step_bounds.summarize(step_bounds.load(str(path)), least_gap_s=0.0)
    assert s["steps"] == 3 and s["compute_tracks"] == ["d0(cpu) compute"]
    rows = s["tracks"]
    for track in ("d0(cpu) compute", "d0(cpu) parameter upload", "d0(cpu) gradient download", "optimizer"):
        assert 0 < rows[track]["busy_s_per_step"] * s["steps"] <= s["window_s"], track
    assert all(0 <= r["share"] <= 1 for r in rows.values())
    # every layer's weights go up at least once a pass (sizes named to 0.1 MiB), gradients come down once
    assert s["upload_bytes_per_step"] >= layers * 0.95 * 2**20
    assert s["download_bytes_per_step"] >= layers * 0.95 * 2**20
    assert rows["d0(cpu) parameter upload"]["bytes_per_step"] <= s["upload_bytes_per_step"]


def test_the_bench_group_runs_both_workloads_traced_then_the_tool_on_each_trace(tmp_path):
    import re

    from test_bench_script_groups import bench

    from benchmarks import run

    workloads = ["qwen3-4b-full-s4096-b8-cap24", "llama3.1-8b-lora-s4096-b8-cap24"]
    traces = tmp_path / "out" / "traces"
    traces.mkdir(parents=True)
    for w in workloads:  # what run.py --trace-dir would have written (the stub python3 runs nothing)
        (traces / f"{w}-roundpipe-engine-s4096-nNone.json").write_text("{}")
    done, calls, log = bench(tmp_path, "dense-cap24-profile")
    assert done.returncode == 0, done.stderr
    assert [c.split()[0] for c in calls] == ["benchmarks/run.py"] * 2 + ["benchmarks/step_bounds.py"] * 4 + [
        "benchmarks/call_summary.py"]
    for call, w in zip(calls, workloads):
        args = run.parse_args(call.split()[1:])
        assert (args.workload, args.system, args.nms, args.warm, args.iters, args.roundpipe) == (
            w, "roundpipe-engine", "auto", 2, 3, {})
        assert args.trace_dir == str(tmp_path / "out" / "traces")
    for call, w in zip(calls[2:6], [workloads[0]] * 2 + [workloads[1]] * 2):
        args = step_bounds.parse_args(call.split()[1:])
        assert (Path(args.trace).name, args.steps, args.workload) == (
            f"{w}-roundpipe-engine-s4096-nNone.json", 3, w)
    assert [step_bounds.parse_args(c.split()[1:]).json for c in calls[2:6]] == [False, True] * 2
    limits = [int(m) for m in re.findall(r"^=== \[\d+ s\] (\d+) python3 benchmarks/run.py", log, re.M)]
    assert limits == [150, 200]


def _two_passes_with_weight_waits() -> dict:
    """Two passes on one device: the caller's waits for each loss, the compute and upload tracks, and two
    overlapping weight waits inside the second pass's first task."""
    tracks = ("caller", "d0(cuda:0) compute", "d0(cuda:0) parameter upload", "d0(cuda:0) weights wait")
    events = [{"ph": "M", "name": "thread_name", "pid": 0, "tid": i, "args": {"name": n}} for i, n in enumerate(tracks)]

    def span(tid, name, start, dur):
        return {"ph": "X", "name": name, "pid": 0, "tid": tid, "ts": start * 1e6, "dur": dur * 1e6}

    events += [span(0, "wait for the loss of pass 0", 0.0, 4.0), span(0, "wait for the loss of pass 1", 4.0, 4.0)]
    events += [span(1, "F0:L0-0:r0:m0-0@d0", 0.0, 2.0), span(1, "B0:L0-0:r0:m0-0@d0", 2.0, 1.5)]
    events += [span(1, "F0:L0-0:r0:m0-0@d0", 4.0, 2.0), span(1, "B0:L0-0:r0:m0-0@d0", 6.0, 1.5)]
    events += [span(2, "1.0 MiB", 3.5, 1.0), span(2, "1.0 MiB", 4.5, 1.0)]  # the first crosses into the window
    events += [span(3, "L0", 4.0, 0.5), span(3, "L0", 4.25, 0.5)]  # overlapping waits count once
    return {"traceEvents": events}


def test_each_task_of_the_window_with_its_time_and_its_waits_for_weights(tmp_path, capsys):
    s = step_bounds.summarize(_two_passes_with_weight_waits())  # the last pass: [4, 7.5]
    assert s["tracks"]["d0(cuda:0) parameter upload"]["busy_s_per_step"] == 1.5  # 0.5 of the first copy, the second
    assert s["tracks"]["d0(cuda:0) weights wait"]["busy_s_per_step"] == 0.75
    assert [(t["task"], t["start_s"], t["seconds"], t["weights_wait_s"]) for t in s["tasks"]] == [
        ("F0:L0-0:r0:m0-0@d0", 0.0, 2.0, 0.75), ("B0:L0-0:r0:m0-0@d0", 2.0, 1.5, 0.0)]
    assert "B0:L0-0:r0:m0-0@d0" in step_bounds.format_table(s)
    # gzipped, as the benchmarks keep their traces, through the command line
    path = tmp_path / "trace.json.gz"
    path.write_bytes(gzip.compress(json.dumps(_two_passes_with_weight_waits()).encode()))
    assert len(step_bounds.main([str(path)])["tasks"]) == 2
    assert "waiting for weights" in capsys.readouterr().out
