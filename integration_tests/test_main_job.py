"""The main job (`python -m accelerate_roundpipe.tiny.train`, what scripts/train.sh runs): it says RoundPipe is on,
saves its model and prints where, and leaves no empty temporary directory behind."""

from __future__ import annotations

import os
import re
import sys

from roundpipe_testing import run_subprocess, subprocess_env


def test_main_job_saves_its_model_and_leaves_no_empty_directories(tmp_path):
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = subprocess_env(str(tmp_path), {"TMPDIR": str(temp)})
    result = run_subprocess(
        [
            sys.executable,
            "-m",
            "accelerate_roundpipe.tiny.train",
            "--max_steps",
            "20",
            "--hidden_size",
            "32",
            "--num_hidden_layers",
            "2",
            "--block_size",
            "32",
            "--batch_size",
            "4",
            "--num_microbatches",
            "2",
            "--devices",
            "cpu,cpu",
        ],
        env,
        timeout=300,
    )
    assert result.stderr.count("[roundpipe] RoundPipe is on: 2 worker(s) (cpu, cpu)") == 1
    assert re.search(r"^held-out loss at the end: \d+\.\d+ ", result.stdout, re.MULTILINE), result.stdout
    assert re.search(r"^step +5  held-out loss ", result.stdout, re.MULTILINE), result.stdout  # the curve on the way
    saved = re.search(r"^model saved to (\S+) ", result.stdout, re.MULTILINE)
    assert saved, result.stdout
    output_dir = saved.group(1)
    assert os.path.dirname(output_dir) == str(temp)  # the default: a new temporary directory
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(os.listdir(output_dir))
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(output_dir)
    assert model.config.num_hidden_layers == 2
    empty = [root for root, dirs, files in os.walk(temp) if not dirs and not files]
    assert empty == [], f"empty directories left behind: {empty}"
    assert os.listdir(temp) == [os.path.basename(output_dir)]
