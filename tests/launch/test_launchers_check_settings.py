"""The launchers refuse bad settings before the user's script runs: `python -m accelerate_roundpipe.run` before the
script's first line, `accelerate-roundpipe launch` before accelerate's launcher starts anything."""

from __future__ import annotations

import os
import subprocess
import sys
from unittest import mock

import pytest
import torch

from accelerate_roundpipe.launch import cli, config_file

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


def _marker_script(tmp_path) -> tuple[str, str]:
    marker = str(tmp_path / "started")
    script = tmp_path / "script.py"
    script.write_text(f"open({marker!r}, 'w').close()\n")
    return str(script), marker


def _clean_env(**roundpipe: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROUNDPIPE_")}
    return {**env, **roundpipe}


@needs_no_cuda
def test_run_refuses_cuda_devices_before_the_script_starts(tmp_path):
    """Before: the script ran (and, being run_clm.py, tokenized its data) before `train()` refused the devices."""
    script, marker = _marker_script(tmp_path)
    done = subprocess.run([sys.executable, "-m", "accelerate_roundpipe.run", script], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env=_clean_env(ROUNDPIPE_DEVICES="cuda:0"))
    assert not os.path.exists(marker), "the script's first line ran"
    assert done.returncode != 0 and "ROUNDPIPE_DEVICES" in done.stderr and "names CUDA devices" in done.stderr


def _launch(argv: list[str], env: dict[str, str]) -> list:
    launched = []
    with mock.patch.dict(os.environ, _clean_env(**env), clear=True), \
            mock.patch("accelerate.commands.launch.launch_command", launched.append):
        cli.main(["launch", *argv])
    return launched


@needs_no_cuda
def test_launch_refuses_cuda_devices_before_launching(tmp_path):
    script, _ = _marker_script(tmp_path)
    with pytest.raises(SystemExit, match="ROUNDPIPE_DEVICES.*names CUDA devices") as refused:
        _launch(["--roundpipe", script], {"ROUNDPIPE_DEVICES": "cuda:0"})
    assert refused.value.code == 2
    config = str(tmp_path / "c.yaml")
    config_file.write_config({**config_file.base_accelerate_config(use_cpu=True),
                              "roundpipe": {"enabled": True, "devices": "cuda:0"}}, config)
    with pytest.raises(SystemExit, match=f"`devices: cuda:0` in the `roundpipe:` section of {config} names CUDA "
                                         f"devices") as refused:
        _launch(["--config_file", config, script], {})
    assert refused.value.code == 2


def test_launch_refuses_a_timeout_that_cannot_work(tmp_path):
    script, _ = _marker_script(tmp_path)
    with pytest.raises(SystemExit, match=r"ROUNDPIPE_WAIT_TIMEOUT_S='nan'.*must be"):
        _launch(["--roundpipe", script], {"ROUNDPIPE_DEVICES": "cpu", "ROUNDPIPE_WAIT_TIMEOUT_S": "nan"})
    assert len(_launch(["--roundpipe", script], {"ROUNDPIPE_DEVICES": "cpu", "ROUNDPIPE_WAIT_TIMEOUT_S": "30"})) == 1


def test_config_command_refuses_a_timeout_that_cannot_work(tmp_path):
    with pytest.raises(ValueError, match=r"wait_timeout_s.*must be"):
        cli.config_command(["--config_file", str(tmp_path / "c.yaml"), "--devices", "cpu", "--wait_timeout_s", "-5"])
    assert not os.path.exists(tmp_path / "c.yaml")
