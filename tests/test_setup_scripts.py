"""The set-up scripts: `scripts/train.sh` installs only what the main job needs (the package), `scripts/test.sh` the
test and docs extras too; and the main job's default length ([Note: main job length] in `tiny/train.py`)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _commands_run_by(script: str, tmp_path: Path) -> list[str]:
    """The `python3` command lines `script` runs, with a stand-in `python3` that records them and does nothing."""
    bin_dir, record = tmp_path / "bin", tmp_path / "calls.txt"
    bin_dir.mkdir()
    fake = bin_dir / "python3"
    fake.write_text(f'#!/bin/sh\necho "$*" >> "{record}"\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    subprocess.run(["bash", str(ROOT / "scripts" / script)], check=True, env=env, timeout=60,
                   stdout=subprocess.DEVNULL)
    return record.read_text().splitlines()


def _pip_installs(calls: list[str]) -> list[str]:
    return [call for call in calls if call.startswith("-m pip install")]


def test_train_script_installs_the_package_without_extras(tmp_path):
    calls = _commands_run_by("train.sh", tmp_path)
    assert _pip_installs(calls) == ["-m pip install -q -e ."], calls
    assert calls[-1] == "-m accelerate_roundpipe.tiny.train"


def test_test_script_installs_the_test_and_docs_extras(tmp_path):
    calls = _commands_run_by("test.sh", tmp_path)
    assert _pip_installs(calls) == ["-m pip install -q -e .[test,docs]"], calls


@pytest.mark.parametrize("argv, steps", [([], 100), (["--max_steps", "20"], 20)])
def test_main_job_default_length_ends_near_the_best_held_out_loss(argv, steps):
    from accelerate_roundpipe.tiny.train import parse_args

    assert parse_args(argv).max_steps == steps  # 160 overfit the shipped text: [Note: main job length]
