"""`scripts/device/bench.sh`'s mixture-of-experts and 32B groups, without a GPU: the script runs in a copy of the
tree with a `python3` on PATH that only writes down its arguments, so what each group would run (its commands, their
time limits) is read back, and our command lines are checked by `benchmarks/run.py`'s own parser."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import run  # noqa: E402

GROUPS = {  # group: (our workload, the anchors' --model)
    "moe-cap24": ("qwen3-30b-a3b-lora-s4096-b8-cap24", "qwen3-30b-a3b"),
    "gpt-oss-cap24": ("gpt-oss-20b-lora-s4096-b8-cap24", "gpt-oss-20b"),
    "dense-32b-cap24": ("qwen3-32b-lora-s4096-b8-cap24", "qwen3-32b"),
}

# warm-up and timed steps: 2 warm-up steps at least, so that no timed step is the measured plan's first pass
STEPS = {"moe-cap24": (2, 4), "gpt-oss-cap24": (2, 3), "dense-32b-cap24": (2, 3)}


def bench(tmp_path: Path, *names: str) -> tuple[subprocess.CompletedProcess, list[str], str]:
    """Runs bench.sh NAMES in a copy of the tree; (the process, each python3 call's arguments, bench.log)."""
    tree = tmp_path / "tree"
    (tree / "scripts" / "device").mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "scripts" / "device" / "bench.sh", tree / "scripts" / "device" / "bench.sh")
    (tree / ".anchors").mkdir(exist_ok=True)
    (tree / ".anchors" / "rp.py").write_text("")
    stub = tmp_path / "bin"
    stub.mkdir(exist_ok=True)
    calls = tmp_path / "calls.txt"
    (stub / "python3").write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    (stub / "python3").chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "PATH": f"{stub}:{os.environ['PATH']}", "OUT": str(out), "BENCH_COMMIT": "test"}
    env.pop("BENCH_CALL_S", None)
    done = subprocess.run(["bash", str(tree / "scripts" / "device" / "bench.sh"), *names], env=env,
                          capture_output=True, text=True, timeout=60)
    lines = calls.read_text().splitlines() if calls.exists() else []
    log = (out / "bench.log").read_text() if (out / "bench.log").exists() else ""
    return done, lines, log


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_group_runs_ours_then_the_reference(tmp_path, group):
    workload, model = GROUPS[group]
    done, calls, log = bench(tmp_path, group, "anchors")
    assert done.returncode == 0, done.stderr
    ours, reference = calls[0], calls[1]
    assert ours.startswith("benchmarks/run.py ") and reference.startswith(".anchors/rp.py ")
    args = run.parse_args(ours.split()[1:])  # our command line is one run.py takes
    warm, iters = STEPS[group]
    assert (args.workload, args.system, args.nms, args.warm, args.iters) == (
        workload, "roundpipe-engine", "auto", warm, iters)
    assert args.roundpipe == {}  # the engine at its defaults (the exact step)
    assert reference.split()[1:] == ["--model", model, "--lora", "--cap", "24", "--seqs", "4096", "--gb", "8",
                                     "--nms", "4", "--warm", str(warm), "--iters", str(iters), "--section",
                                     f"{group}-reference"]
    # each in its own process under 240 s: the pair fits one call
    limits = [int(m) for m in re.findall(r"^=== \[\d+ s\] (\d+) python3 (?:benchmarks/run.py|\.anchors/rp.py)", log,
                                         re.M)]
    assert limits == [240, 240]
    assert calls[2].startswith("benchmarks/call_summary.py")


def test_group_without_anchors_runs_ours_only(tmp_path):
    done, calls, _ = bench(tmp_path, "moe-cap24")
    assert done.returncode == 0, done.stderr
    assert [c.split()[0] for c in calls] == ["benchmarks/run.py", "benchmarks/call_summary.py"]


def test_unknown_name_runs_nothing(tmp_path):
    done, calls, _ = bench(tmp_path, "moe-cap24", "moe-cap42")
    assert done.returncode == 2 and "unknown workload: moe-cap42" in done.stderr
    assert calls == []
    for group in GROUPS:  # the usage line lists the groups
        assert f" {group}" in done.stderr


def test_reference_flags_are_rp_py_s():
    # the reference's command line uses only flags the anchors' rp.py defines (when a copy is at hand)
    for path in (ROOT / ".anchors" / "rp.py", ROOT.parent / "shared" / "anchors" / "rp.py"):
        if path.is_file() and path.stat().st_size:
            defined = set(re.findall(r'add_argument\("(--[a-z-]+)"', path.read_text()))
            break
    else:
        pytest.skip("no copy of the anchors' rp.py")
    script = (ROOT / "scripts" / "device" / "bench.sh").read_text()
    for group in GROUPS:
        branch = re.search(rf"^  {group}\)(.*?);;", script.split("run_anchors()")[1], re.M | re.S)
        assert branch, group
        assert set(re.findall(r"(--[a-z-]+)", branch.group(1))) <= defined


def test_lora_adds_groups_run_each_computation_in_turn(tmp_path):
    """`lora-adds` and `lora-adds-32b`: the same workload twice, the second with PEFT's own LoRA forward
    (`--peft-lora-adds`, which run.py's parser takes), and the layer profile's A/B systems."""
    from benchmarks import dense_layer_profile

    done, calls, _ = bench(tmp_path, "lora-adds", "lora-adds-32b")
    assert done.returncode == 0, done.stderr
    profile = [c for c in calls if c.startswith("benchmarks/dense_layer_profile.py")]
    assert len(profile) == 1
    systems = profile[0].split("--systems ")[1].split()[0].split(",")
    assert set(systems) <= set(dense_layer_profile.SYSTEMS) and "engine-stages-peft-adds" in systems
    runs = [run.parse_args(c.split()[1:]) for c in calls if c.startswith("benchmarks/run.py")]
    assert [(a.workload, a.peft_lora_adds) for a in runs] == [
        ("llama3.1-8b-lora-s4096-b8-cap24", False), ("llama3.1-8b-lora-s4096-b8-cap24", True),
        ("qwen3-32b-lora-s4096-b8-cap24", False), ("qwen3-32b-lora-s4096-b8-cap24", True)]
    assert any(c.startswith(".anchors/ingpu.py --liger --model llama3.1-8b") for c in calls)


def test_the_32b_ab_group_runs_the_default_then_each_change_taken_out(tmp_path):
    done, calls, log = bench(tmp_path, "dense-32b-cap24-ab")
    assert done.returncode == 0, done.stderr
    ours = [run.parse_args(c.split()[1:]) for c in calls if c.startswith("benchmarks/run.py ")]
    assert [(a.workload, a.warm, a.iters) for a in ours] == [("qwen3-32b-lora-s4096-b8-cap24", 2, 3)] * 3
    assert [(a.one_layer_first_pass, a.keep_idle_buffers) for a in ours] == [(False, False), (True, False),
                                                                             (False, True)]
    assert all(a.roundpipe == {} for a in ours)  # the engine's defaults otherwise
    assert sum(int(m) for m in re.findall(r"^=== \[\d+ s\] (\d+) python3", log, re.M)) <= 585  # one call


def _own_command(tmp_path, group: str, module) -> argparse.Namespace:
    """The arguments of the group's one command, a script with its own parser: parsed by that parser (a command
    line it would refuse fails here)."""
    done, calls, _ = bench(tmp_path, group)
    assert done.returncode == 0, done.stderr
    command = calls[0].split()
    assert command[0] == f"benchmarks/{module.__name__.rsplit('.', 1)[-1]}.py"
    return module.parse_args(command[1:])


def test_the_call_memory_group_runs_each_count(tmp_path):
    from benchmarks import call_memory

    args = _own_command(tmp_path, "call-memory", call_memory)
    assert (args.workload, args.call_rows, args.accumulation, args.steps) == (
        "qwen3-4b-full-s4096-b8-cap24", 8, "1,8", 3)


def test_the_moe_idle_buffers_ab_group_runs_the_default_then_the_buffers_kept(tmp_path):
    done, calls, _ = bench(tmp_path, "moe-cap24-idle-ab")
    assert done.returncode == 0, done.stderr
    ours = [run.parse_args(c.split()[1:]) for c in calls if c.startswith("benchmarks/run.py ")]
    assert [(a.workload, a.keep_idle_buffers, a.roundpipe) for a in ours] == [
        ("qwen3-30b-a3b-lora-s4096-b8-cap24", False, {}), ("qwen3-30b-a3b-lora-s4096-b8-cap24", True, {})]
    assert ours[0].trace_dir != ours[1].trace_dir  # the two traces apart


@pytest.mark.parametrize("group, workload", [("cap24-limits-ab", "qwen3-4b-full-s4096-b8-cap24"),
                                             ("moe-cap24-limits-ab", "qwen3-30b-a3b-lora-s4096-b8-cap24")])
def test_the_limits_ab_groups_run_the_default_then_the_limits_as_before(tmp_path, group, workload):
    done, calls, log = bench(tmp_path, group)
    assert done.returncode == 0, done.stderr
    ours = [run.parse_args(c.split()[1:]) for c in calls if c.startswith("benchmarks/run.py ")]
    assert [(a.workload, a.limits_without_placed_state, a.roundpipe) for a in ours] == [
        (workload, False, {}), (workload, True, {})]
    assert ours[0].trace_dir != ours[1].trace_dir  # the two traces apart
    assert sum(int(m) for m in re.findall(r"^=== \[\d+ s\] (\d+) python3", log, re.M)) <= 585  # one call


def test_the_swap_rate_group_runs_the_benchmark_with_arguments_it_takes(tmp_path):
    from benchmarks import swap_rate

    args = _own_command(tmp_path, "swap-rate", swap_rate)
    assert (args.gib, args.buckets, args.bucket_gib) == (4.0, 8, 1.0)


def test_the_pieces_ab_group_runs_the_baseline_then_the_disk_with_and_without_pieces(tmp_path):
    done, calls, log = bench(tmp_path, "disk-cap24-b64-pieces-ab")
    assert done.returncode == 0, done.stderr
    ours = [run.parse_args(c.split()[1:]) for c in calls if c.startswith("benchmarks/run.py ")]
    assert [(a.workload, a.roundpipe, a.one_swap_file, a.four_io_threads) for a in ours] == [
        ("qwen3-4b-full-s4096-b64-cap24", {}, False, False),
        ("qwen3-4b-full-s4096-b64-cap24", {"host_memory_budget": "24"}, False, False),
        ("qwen3-4b-full-s4096-b64-cap24", {"host_memory_budget": "24"}, True, True)]
    assert sum(int(m) for m in re.findall(r"^=== \[\d+ s\] (\d+) python3", log, re.M)) <= 585  # one call


def test_every_variant_switch_names_an_attribute_its_module_has():
    """A switch sets one module attribute; a renamed attribute would make it set a new, unused name silently."""
    import importlib

    for switch in run.VARIANT_SWITCHES:
        module = importlib.import_module(switch.module)
        assert hasattr(module, switch.attribute), (switch.flag, switch.module, switch.attribute)
        assert type(getattr(module, switch.attribute)) is type(switch.value), switch.flag
        assert run.parse_args(["--workload", "tiny-llama-full-s16-b4", "--system", "roundpipe-engine", "--out", "o",
                               f"--{switch.flag}"]).__dict__[switch.flag.replace("-", "_")] is True
