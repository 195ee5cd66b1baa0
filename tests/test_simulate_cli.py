"""`accelerate-roundpipe simulate` as a command line: every device and micro-batch count prints RoundPipe's numbers
(a classic schedule that cannot be built is a marked row), and bad input is one argparse error line with status 2."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from argparse import Namespace

import pytest

from accelerate_roundpipe.plan import classic
from accelerate_roundpipe.plan.classic import compare_bubbles, interleaved_one_f_one_b
from accelerate_roundpipe.plan.simulate_cli import main, relative_forward_costs

CLASSIC = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs")
ROUNDPIPE = ("roundpipe_sync", "roundpipe_async")
# What `telemetry.report --profile-out` writes for the main job's model (scripts/train.sh: embedding, 4 decoder
# layers, the head): 6 layers, seconds per micro-batch.
SIX_LAYER_PROFILE = {"forward": [0.0004, 0.0098, 0.0097, 0.0098, 0.0099, 0.021]}


def _profile(tmp_path, data) -> str:
    path = tmp_path / "costs.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def _rows(out: str) -> dict[str, str]:
    """The table's rows: schedule name -> what it says."""
    return dict(re.match(r"  (\S+)\s+(.*)", line).groups() for line in out.splitlines() if line.startswith("  "))


def _expected_not_built(devices: int, microbatches: int, layers: int, chunks: int = 2) -> set[str]:
    """Which classic schedules cannot be built: one stage per device (two per device for the virtual-stage
    schedules) needs as many layers; interleaved 1F1B runs micro-batches in groups of the device count."""
    missing = {name for name in ("gpipe", "1f1b") if devices > layers}
    missing |= {"looped_bfs"} if devices * chunks > layers else set()
    if devices * chunks > layers or microbatches % devices:
        missing.add("interleaved_1f1b")
    return missing


@pytest.mark.parametrize("source", ["model", "profile"])
def test_every_device_and_microbatch_count_prints_roundpipes_rows(source, tmp_path, capsys):
    """Devices 1..8 x micro-batches 1..16: exit normally, RoundPipe's two rows always a percentage, each classic
    row a percentage or 'n/a: <why>' exactly where that schedule cannot be built."""
    if source == "model":
        args, layers = ["--model", "qwen3-1.7b"], 30
    else:
        args, layers = ["--profile", _profile(tmp_path, SIX_LAYER_PROFILE)], 6
    for devices in range(1, 9):
        for microbatches in range(1, 17):
            main(args + ["--devices", str(devices), "--microbatches", str(microbatches)])
            rows = _rows(capsys.readouterr().out)
            assert set(rows) == set(CLASSIC + ROUNDPIPE), (devices, microbatches)
            for name in ROUNDPIPE:
                assert re.fullmatch(r"\d+\.\d%", rows[name]), (devices, microbatches, rows)
            missing = {name for name in CLASSIC if rows[name].startswith("n/a: ")}
            assert missing == _expected_not_built(devices, microbatches, layers), (devices, microbatches, rows)
            assert all(re.fullmatch(r"\d+\.\d%", rows[name]) for name in set(CLASSIC) - missing)


def test_the_reported_cases_say_why(tmp_path, capsys):
    main(["--model", "qwen3-1.7b", "--devices", "3", "--microbatches", "8"])
    rows = _rows(capsys.readouterr().out)
    assert rows["interleaved_1f1b"] == ("n/a: needs micro-batches a multiple of devices (8 micro-batches on 3 "
                                        "devices)")
    assert rows["gpipe"] == "{:.1%}".format(compare_bubbles(3, 8, relative_forward_costs(
        Namespace(profile=None, model="qwen3-1.7b", seq=4096, head_layers=None)))["gpipe"])

    main(["--profile", _profile(tmp_path, SIX_LAYER_PROFILE), "--devices", "4", "--microbatches", "8"])
    rows = _rows(capsys.readouterr().out)
    reason = "n/a: needs 8 stages (4 devices x 2 chunks), more than the 6 layers"
    assert rows["interleaved_1f1b"] == rows["looped_bfs"] == reason
    assert rows["gpipe"].endswith("%") and rows["1f1b"].endswith("%")


def test_json_marks_a_schedule_not_built(capsys):
    result = main(["--model", "qwen3-1.7b", "--devices", "6", "--microbatches", "8", "--json"])
    printed = json.loads(capsys.readouterr().out)
    assert printed["interleaved_1f1b"] is None
    assert printed["not_built"] == {"interleaved_1f1b": "needs micro-batches a multiple of devices (8 micro-batches "
                                                        "on 6 devices)"}
    assert 0 < printed["roundpipe_async"] < printed["roundpipe_sync"] < 1
    assert isinstance(result["interleaved_1f1b"], classic.NotBuilt)


def test_the_python_api_keeps_its_exceptions(tmp_path):
    with pytest.raises(ValueError, match="interleaved 1F1B needs micro-batches a multiple of devices"):
        interleaved_one_f_one_b(3, 8, [1.0] * 30)
    with pytest.raises(ValueError, match="at least one device"):
        compare_bubbles(0, 8, [1.0] * 30)
    with pytest.raises(FileNotFoundError):
        relative_forward_costs(Namespace(profile=str(tmp_path / "missing.json"), head_layers=None))
    path = tmp_path / "bad.json"
    path.write_text("[1,")
    with pytest.raises(ValueError, match="--profile .*bad.json: not JSON"):
        relative_forward_costs(Namespace(profile=str(path), head_layers=None))


def _error_line(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert lines[0].startswith("usage: accelerate-roundpipe simulate")
    return lines[-1]


COUNTS = ["--model", "qwen3-1.7b", "--devices", "2", "--microbatches", "4"]


@pytest.mark.parametrize("flag, value", [("--devices", "0"), ("--devices", "-3"), ("--microbatches", "0"),
                                         ("--chunks", "0"), ("--seq", "0"), ("--head-layers", "-1"),
                                         ("--head-layers", "nan")])
def test_a_count_out_of_range_is_an_argparse_error(flag, value, capsys):
    argv = list(COUNTS)
    if flag in argv:
        argv[argv.index(flag) + 1] = value
    else:
        argv += [flag, value]
    line = _error_line(capsys, argv)
    assert line.startswith(f"accelerate-roundpipe simulate: error: argument {flag}: ")
    assert f"got {value}" in line


@pytest.mark.parametrize("content, says", [
    (None, "no such file"),
    ('{"forward": [1, 2', "not JSON (Expecting"),
    ('{"backward": [1, 2]}', "needs a list of per-layer forward costs or {\"forward\": [...]}"),
    ('"fast"', "needs a list of per-layer forward costs or {\"forward\": [...]}"),
    ("[]", "has no layers"),
    ('[0.1, "x", 0.3]', "layer 1's cost is 'x', not a number"),
    ("[0.1, true, 0.3]", "layer 1's cost is True, not a number"),
    ("[0.1, 0.2, -0.3]", "layer 2's cost is -0.3: costs are times, at least 0"),
    ("[0.1, NaN, 0.3]", "layer 1's cost is nan: costs are times, at least 0"),
    ("[0, 0, 0]", "every layer costs 0"),
    ("[0.1, 0, 0.3]", "layer 1 (the first decoder layer, the unit of the costs) costs 0"),
])
def test_a_missing_or_malformed_profile_is_an_argparse_error(content, says, tmp_path, capsys):
    path = tmp_path / "bad.json" if content is None else tmp_path / "costs.json"
    if content is not None:
        path.write_text(content)
    line = _error_line(capsys, ["--profile", str(path), "--devices", "2", "--microbatches", "4"])
    assert line.startswith(f"accelerate-roundpipe simulate: error: --profile {path}: ")
    assert says in line


def test_flags_that_would_be_ignored_are_refused(capsys):
    line = _error_line(capsys, COUNTS + ["--grid"])
    assert line == "accelerate-roundpipe simulate: error: --grid prints the split-head plan's grid: add --split-head"
    line = _error_line(capsys, COUNTS + ["--actions", "--json"])
    assert line == ("accelerate-roundpipe simulate: error: --actions prints text and --json prints only JSON: "
                    "pass one of them")


def test_the_console_command_exits_2_with_one_line(tmp_path):
    """Through `accelerate-roundpipe simulate` itself (launch/cli.py), in a process of its own."""
    for argv, flag in [(COUNTS[:2] + ["--devices", "0", "--microbatches", "4"], "argument --devices"),
                       (["--profile", str(tmp_path / "nope.json"), "--devices", "2", "--microbatches", "4"],
                        f"--profile {tmp_path / 'nope.json'}: no such file")]:
        done = subprocess.run([sys.executable, "-m", "accelerate_roundpipe.launch.cli", "simulate", *argv],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr
        assert done.stderr.strip().splitlines()[-1].startswith(f"accelerate-roundpipe simulate: error: {flag}")
