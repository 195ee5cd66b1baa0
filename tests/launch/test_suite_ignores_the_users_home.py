"""The test suite never reads the user's own settings: not the accelerate config that `accelerate-roundpipe config`
writes to ~/.cache/huggingface/accelerate/roundpipe_config.yaml (the README's way 1), not ROUNDPIPE_* variables the
user exported. The suite's conftest.py (the repository root's) points HF_HOME at a directory of its own and
clears ROUNDPIPE_*, before anything imports accelerate, for every subprocess a test starts too."""

from __future__ import annotations

import os
import subprocess
import sys

from accelerate_roundpipe.launch import config_file

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRINT_DEFAULT_PATH = ("from accelerate_roundpipe.launch.config_file import default_config_path; "
                      "print(default_config_path())")


def _under(path: str, directory: str) -> bool:
    return os.path.commonpath([os.path.realpath(path), os.path.realpath(directory)]) == os.path.realpath(directory)


def test_the_default_config_lies_in_the_suites_own_home_not_the_users():
    """Before: HF_HOME unset, so the default config was ~/.cache/huggingface/accelerate/roundpipe_config.yaml."""
    home = os.environ.get("HF_HOME")
    assert home and not _under(home, os.path.join(os.path.expanduser("~"), ".cache")), home
    assert _under(config_file.default_config_path(), home)
    assert not [name for name in os.environ if name.startswith("ROUNDPIPE_")]
    done = subprocess.run([sys.executable, "-c", PRINT_DEFAULT_PATH], capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert _under(done.stdout.strip(), home), done.stdout  # a subprocess a test starts sees the same home


def test_a_users_config_and_variables_leave_the_launch_tests_unchanged(tmp_path):
    """Before: with this home, 5 tests failed (test_launch_wraps_the_script_and_exports_the_section,
    test_launch_accepts_one_process_per_machine, two cases of test_launch_refuses_one_process_per_gpu_and_sharding,
    integration_tests/test_bad_input.py::test_data_parallel_style_settings)."""
    home = tmp_path / "home"
    user_config = home / ".cache" / "huggingface" / "accelerate" / "roundpipe_config.yaml"
    # What `accelerate-roundpipe config --devices cuda:0,cuda:1 --num_microbatches 8` writes on a two-GPU machine.
    config_file.write_config({**config_file.base_accelerate_config(use_cpu=False),
                              "roundpipe": {"enabled": True, "devices": "cuda:0,cuda:1", "num_microbatches": 8}},
                             str(user_config))
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HOME", "XDG_CACHE_HOME")}
    env.update({"HOME": str(home), "ROUNDPIPE_DEVICES": "cuda:0", "ROUNDPIPE_NUM_MICROBATCHES": "8",
                "ROUNDPIPE_NUM_MICROBATCH": "8"})
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/launch/test_config_file_and_cli.py",
                           "integration_tests/test_bad_input.py::test_data_parallel_style_settings"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "failed" not in done.stdout, done.stdout[-3000:]
    assert user_config.read_text().count("cuda:0,cuda:1") == 1  # read by nobody, written by nobody else
