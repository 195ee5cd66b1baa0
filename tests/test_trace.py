"""The timeline trace of a CPU run: valid Chrome JSON, one track per worker plus the optimizer, every task."""

from __future__ import annotations

import gzip
import json

import pytest
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


def test_report_measured_and_simulated_bubble_and_png(tmp_path):
    import pytest

    from accelerate_roundpipe.telemetry.report import load_task_spans, main, measured_bubble, simulated_bubble

    path = tmp_path / "trace.json"
    engine = RoundPipe(tied_model(), RoundPipeConfig(devices=["cpu"] * 2, num_microbatches=4, trace_path=str(path)))
    tasks = []
    for k in range(3):
        tasks += engine.schedule(4)
        x, mask, y = batch(rows=8, seed=k)
        engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy)
    engine.close()
    spans = load_task_spans(str(path))
    assert [s.task for s in spans if s.track.startswith("d0")] == [t for t in tasks if t.device_index == 0]
    assert 0.0 <= measured_bubble(spans) < 1.0 and 0.0 <= simulated_bubble(spans, 2) < 1.0
    pytest.importorskip("matplotlib")
    report = main([str(path), "--png", str(tmp_path / "gantt.png")])
    assert (tmp_path / "gantt.png").stat().st_size > 1000 and report["tasks"] == len(tasks)


def test_report_on_a_hand_made_trace(tmp_path):
    """Two devices, unit-cost tasks of one micro-batch, and a 1-unit stall on d1: exact bubbles."""
    from accelerate_roundpipe.plan import build_schedule, plan_partition
    from accelerate_roundpipe.telemetry.report import load_task_spans, measured_bubble, simulated_bubble

    tasks = build_schedule(plan_partition(2, backward_stages=[1, 1], forward_stages=[1]), 1, 1, 2)
    assert [str(t) for t in tasks] == ["F0:L0-0:r0:m0-0@d0", "FB1:L1-1:r0:m0-0@d1", "B0:L0-0:r0:m0-0@d0"]
    starts = [0.0, 2.0, 3.0]  # FB waits one unit longer than its input needs (a stall)
    events = [{"ph": "M", "name": "thread_name", "pid": 0, "tid": d, "args": {"name": f"d{d}(cpu) host"}}
              for d in (0, 1)]
    events += [{"ph": "X", "name": str(t), "pid": 0, "tid": t.device_index, "ts": s * 1e6, "dur": 1e6}
               for t, s in zip(tasks, starts)]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    spans = load_task_spans(str(path))
    assert measured_bubble(spans) == 1 - 3 / (4 * 2)  # 3 busy units in a 4-unit window on 2 devices
    assert simulated_bubble(spans, 2) == 1 - 3 / (3 * 2)  # the replay has no stall: a 3-unit chain


def test_profile_from_a_trace_feeds_the_simulator(tmp_path):
    from accelerate_roundpipe.plan.simulate_cli import main as simulate_main
    from accelerate_roundpipe.telemetry.report import load_task_spans, main

    path = tmp_path / "trace.json"
    engine = RoundPipe(tied_model(), RoundPipeConfig(devices=["cpu"] * 2, num_microbatches=4, trace_path=str(path)))
    x, mask, y = batch(rows=8)
    engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy)
    engine.close()
    main([str(path), "--profile-out", str(tmp_path / "profile.json")])
    costs = json.loads((tmp_path / "profile.json").read_text())["forward"]
    assert len(costs) == len(engine.layers) and all(c > 0 for c in costs)
    assert len(load_task_spans(str(path))) == len(engine.schedule(4))
    result = simulate_main(["--profile", str(tmp_path / "profile.json"), "--devices", "2", "--microbatches", "4"])
    assert 0 <= result["roundpipe_async"] <= result["roundpipe_sync"] < 1


def test_idle_between_passes_counts_only_the_gaps_before_a_pass(tmp_path):
    """One device, two passes of F then B (1 unit each); a 0.5-unit stall inside pass 0 and a 2-unit gap before
    pass 1: the between-pass idle is the gap alone; the last-seconds window drops the first pass."""
    from accelerate_roundpipe.telemetry.report import idle_between_passes, last_seconds, load_task_spans, main

    names = ["F0:L0-0:r0:m0-0@d0", "B0:L0-0:r0:m0-0@d0"] * 2
    starts = [0.0, 1.5, 4.5, 5.5]
    events = [{"ph": "M", "name": "thread_name", "pid": 0, "tid": 0, "args": {"name": "d0(cpu) host"}}]
    events += [{"ph": "X", "name": n, "pid": 0, "tid": 0, "ts": s * 1e6, "dur": 1e6} for n, s in zip(names, starts)]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    spans = load_task_spans(str(path))
    assert idle_between_passes(spans) == 2.0 / 6.5
    assert [s.start for s in last_seconds(spans, 2.0)] == [4.5, 5.5]
    report = main([str(path), "--seconds", "2"])
    assert report["measured_bubble"] == 0.0 and report["idle_between_passes"] == 0.0 and report["tasks"] == 2


def test_waiting_for_weights_is_the_share_of_waits_inside_the_window(tmp_path):
    """[Note: weight waits in the trace]: one device, F then B (2 units each); waits of 0.5 and 1 unit inside them,
    overlapping by 0.25, and one before the window: 1.25 of 4 units waited, and the bubble still says 0."""
    from accelerate_roundpipe.telemetry.report import load_task_spans, load_weight_waits, main, waiting_for_weights

    events = [{"ph": "M", "name": "thread_name", "pid": 0, "tid": 0, "args": {"name": "d0(cuda:0) compute"}},
              {"ph": "M", "name": "thread_name", "pid": 0, "tid": 1, "args": {"name": "d0(cuda:0) weights wait"}}]
    events += [{"ph": "X", "name": n, "pid": 0, "tid": 0, "ts": s * 1e6, "dur": 2e6}
               for n, s in (("F0:L0-0:r0:m0-0@d0", 10.0), ("B0:L0-0:r0:m0-0@d0", 12.0))]
    events += [{"ph": "X", "name": f"L{i}", "pid": 0, "tid": 1, "ts": s * 1e6, "dur": d * 1e6}
               for i, (s, d) in enumerate(((9.0, 0.5), (10.0, 0.5), (10.25, 1.0)))]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    spans, waits = load_task_spans(str(path)), load_weight_waits(str(path))
    assert len(spans) == 2 and len(waits) == 3
    assert waiting_for_weights(spans, waits) == 1.25 / 4
    report = main([str(path), "--png", str(tmp_path / "gantt.png")])
    assert report["measured_bubble"] == 0.0 and report["waiting_for_weights"] == round(1.25 / 4, 4)
    assert (tmp_path / "gantt.png").stat().st_size > 1000


def test_the_report_reads_a_gzipped_trace(tmp_path):
    """The benchmarks keep their traces gzipped; the report reads them as the plain JSON."""
    from accelerate_roundpipe.telemetry.report import main

    events = [{"ph": "M", "name": "thread_name", "pid": 0, "tid": 0, "args": {"name": "d0(cuda:0) compute"}}]
    events += [{"ph": "X", "name": n, "pid": 0, "tid": 0, "ts": s * 1e6, "dur": 1e6}
               for n, s in (("F0:L0-0:r0:m0-0@d0", 0.0), ("B0:L0-0:r0:m0-0@d0", 2.0))]
    plain, packed = tmp_path / "trace.json", tmp_path / "trace.json.gz"
    plain.write_text(json.dumps({"traceEvents": events}))
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert main([str(packed)]) == main([str(plain)]) and main([str(packed)])["measured_bubble"] == round(1 / 3, 4)


@pytest.mark.parametrize("content", [None, b"{not json", b'{"events": []}'])
def test_the_report_refuses_a_missing_or_malformed_trace_in_one_line(tmp_path, capsys, content):
    from accelerate_roundpipe.telemetry.report import main

    path = tmp_path / "trace.json"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(SystemExit) as exit_info:
        main([str(path)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1 and str(path) in err, err


def _trained_engine(path, passes: int = 2):
    engine = RoundPipe(tied_model(), RoundPipeConfig(devices=["cpu"] * 2, num_microbatches=4, trace_path=str(path)))
    optimizer = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-3))
    tasks = []
    for k in range(passes):
        tasks += [str(t) for t in engine.schedule(4)]
        x, mask, y = batch(rows=8, seed=k)
        engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy)
        optimizer.step()
        optimizer.zero_grad()
    return engine, optimizer, tasks


def _task_names(path) -> list[str]:
    trace = json.loads(path.read_text())
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    return sorted(e["name"] for e in trace["traceEvents"] if e["ph"] == "X" and names[e["tid"]].endswith(" host"))


def test_an_engine_dropped_without_close_writes_its_trace_and_is_freed(tmp_path):
    """[Note: trace at exit]: the ways in never call close(); the trace is written when the engine is freed, and
    recording does not keep the engine alive."""
    import gc
    import weakref

    path = tmp_path / "trace.json"
    engine, optimizer, tasks = _trained_engine(path)
    engine.synchronize()  # every task has run (a dropped engine cancels what has not)
    ref = weakref.ref(engine)
    del engine, optimizer
    gc.collect()
    assert ref() is None
    assert _task_names(path) == sorted(tasks)


def test_a_process_that_exits_without_close_writes_its_trace(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).parent
    path = tmp_path / "trace.json"
    script = (f"import sys; sys.path.insert(0, {str(tests)!r})\n"
              "from test_trace import _trained_engine\n"
              f"engine, optimizer, tasks = _trained_engine({str(path)!r})\n"
              "engine.synchronize()\n"
              f"open({str(tmp_path / 'tasks.txt')!r}, 'w').write(chr(10).join(tasks))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests.parent), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"trace written to {path}" in result.stderr
    assert _task_names(path) == sorted((tmp_path / "tasks.txt").read_text().split("\n"))


def test_save_trace_is_not_repeated_at_exit_when_nothing_ran_since(tmp_path):
    path = tmp_path / "trace.json"
    engine, optimizer, _ = _trained_engine(path, passes=1)
    engine.save_trace()
    assert not engine.trace.has_unsaved_spans and engine._trace_saver.alive
    x, mask, y = batch(rows=8, seed=5)
    engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy)
    assert engine.trace.has_unsaved_spans  # the exit would write again: an evaluation after training shows up
    engine.close()
    assert not engine._trace_saver.alive  # closed: written, nothing more to record
