"""A command line that RoundPipe refuses gets one line, `prog: error: ...`, and exit status 2, as argparse gives: no
traceback. The line names the setting as that command line spells it (`--devices` for `accelerate-roundpipe config`,
the `roundpipe:` section's key for `launch`, the training argument or the variable for `python -m
accelerate_roundpipe.run`). Each case runs the real command in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from accelerate_roundpipe.launch import config_file

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLI = [sys.executable, "-m", "accelerate_roundpipe.launch.cli"]
RUN = [sys.executable, "-m", "accelerate_roundpipe.run"]
# A stock Trainer script's first lines: its arguments parsed into (RoundPipe's, under the launcher) TrainingArguments.
HF_SCRIPT = ("from transformers import HfArgumentParser, TrainingArguments\n"
             "HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()\n"
             "open({marker!r}, 'w').close()\n")


def _run(command: list[str], tmp_path, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ROUNDPIPE_")}
    clean.update({"HF_HOME": str(tmp_path / "hf_home"), "PYTHONPATH": REPO, **env})
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, env=clean)


def _one_error_line(done: subprocess.CompletedProcess, prog: str) -> str:
    """The refusal: exit status 2 and exactly one line on stderr, `prog: error: ...`."""
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    assert len(lines) == 1, f"{len(lines)} lines:\n{done.stderr[-3000:]}"
    assert lines[0].startswith(f"{prog}: error: "), lines[0]
    return lines[0]


@pytest.mark.parametrize("flags,named", [
    (["--num_microbatches", "0"], "--num_microbatches 0: num_microbatches must be an integer >= 1"),
    (["--devices", "gpu0,gpu1"], "--devices gpu0,gpu1: devices must be a list of workers"),
    (["--async_optimizer", "maybe"], "--async_optimizer maybe is not a boolean"),
    (["--recompute", "whole"], "--recompute whole: choose one of ['stage', 'layer']"),
])
def test_config_refusals_are_one_line_naming_the_commands_own_flag(tmp_path, flags, named):
    """Before: ~30 lines of chained traceback citing `--roundpipe_<field>`, which `config` does not take."""
    path = tmp_path / "c.yaml"
    line = _one_error_line(_run([*CLI, "config", "--config_file", str(path), *flags], tmp_path),
                           "accelerate-roundpipe config")
    assert named in line and "--roundpipe_" not in line and "ROUNDPIPE_" not in line, line
    assert not path.exists()


def test_config_refuses_cuda_devices_naming_its_own_fix(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    line = _one_error_line(_run([*CLI, "config", "--config_file", str(tmp_path / "c.yaml"), "--devices", "cuda:0"],
                                tmp_path), "accelerate-roundpipe config")
    assert "--devices cuda:0 names CUDA devices" in line and "--devices cpu,cpu" in line, line
    assert "--roundpipe_devices" not in line and "ROUNDPIPE_DEVICES" not in line, line


def test_launch_names_the_config_files_key(tmp_path):
    """Before: "ROUNDPIPE_NUM_MICROBATCHES='zero' in the environment", a variable the user never set."""
    path = str(tmp_path / "c.yaml")
    config_file.write_config({**config_file.base_accelerate_config(use_cpu=True),
                              "roundpipe": {"enabled": True, "devices": "cpu", "num_microbatches": "zero"}}, path)
    line = _one_error_line(_run([*CLI, "launch", "--config_file", path, "train.py"], tmp_path),
                           "accelerate-roundpipe launch")
    assert f"`num_microbatches: zero` in the `roundpipe:` section of {path}: num_microbatches must be" in line, line
    assert "in the environment" not in line and "ROUNDPIPE_" not in line, line


def test_launch_refuses_one_process_per_gpu_with_status_2(tmp_path):
    line = _one_error_line(_run([*CLI, "launch", "--roundpipe", "--multi_gpu", "--num_processes", "8", "train.py"],
                                tmp_path), "accelerate-roundpipe launch")
    assert "start 8 per machine, each driving every visible GPU" in line, line


def test_run_refuses_a_training_argument_in_one_line_naming_it(tmp_path):
    """Before: 21 frames of traceback through HfArgumentParser, the message naming the variable as well."""
    marker = str(tmp_path / "parsed")
    script = tmp_path / "train.py"
    script.write_text(HF_SCRIPT.format(marker=marker))
    line = _one_error_line(_run([*RUN, str(script), "--output_dir", str(tmp_path / "out"), "--report_to", "none",
                                 "--use_cpu", "true", "--roundpipe_devices", "gpu"], tmp_path),
                           "python -m accelerate_roundpipe.run")
    assert "roundpipe_devices='gpu' (a RoundPipeTrainingArguments field, --roundpipe_devices)" in line, line
    assert "ROUNDPIPE_DEVICES" not in line and "'gpu' is not one" in line, line
    assert not os.path.exists(marker)


def test_run_refuses_a_misspelt_variable_in_one_line(tmp_path):
    """Before: 11 frames of traceback."""
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('the script ran')\n")
    line = _one_error_line(_run([*RUN, str(script)], tmp_path, ROUNDPIPE_NUM_MICROBATCH="4"),
                           "python -m accelerate_roundpipe.run")
    assert "ROUNDPIPE_NUM_MICROBATCH (did you mean ROUNDPIPE_NUM_MICROBATCHES?)" in line, line


def test_run_refuses_a_bad_variable_value_in_one_line(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('the script ran')\n")
    line = _one_error_line(_run([*RUN, str(script)], tmp_path, ROUNDPIPE_NUM_MICROBATCHES="zero"),
                           "python -m accelerate_roundpipe.run")
    assert "ROUNDPIPE_NUM_MICROBATCHES='zero': num_microbatches must be an integer >= 1" in line, line


def test_run_without_a_script_is_a_usage_error(tmp_path):
    """Before: the usage on stdout and exit status 0, as if something had run."""
    done = _run(RUN, tmp_path)
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert done.stderr.startswith("usage: python -m accelerate_roundpipe.run") and done.stdout == ""
    assert "python -m accelerate_roundpipe.run: error: a script (or -m module) to run is required" in done.stderr
    done = _run([*RUN, "--help"], tmp_path)
    assert done.returncode == 0 and done.stdout.startswith("usage: python -m accelerate_roundpipe.run")


def test_run_refuses_a_missing_script_in_one_line(tmp_path):
    line = _one_error_line(_run([*RUN, str(tmp_path / "missing.py")], tmp_path),
                           "python -m accelerate_roundpipe.run")
    assert f"no such script: {str(tmp_path / 'missing.py')!r}" in line, line
