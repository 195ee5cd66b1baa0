"""Way 3 for Trainer scripts: a stock HfArgumentParser + Trainer script, unedited, plain vs on RoundPipe."""

from __future__ import annotations

import json
import os
import sys

import pytest
from roundpipe_testing import (
    ROUNDPIPE_ENV,
    TRAINER_SCRIPT,
    assert_close_lists,
    run_in_process,
    run_subprocess,
    subprocess_env,
    trainer_args,
    trainer_log,
)


@pytest.fixture(scope="module")
def plain_run(tiny_assets, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("trainer_plain"))
    run_in_process(TRAINER_SCRIPT, trainer_args(tiny_assets, out, 20, "--do_eval"), roundpipe=False)
    return out


def _eval_loss(output_dir: str) -> float:
    with open(os.path.join(output_dir, "eval_results.json")) as f:
        return json.load(f)["eval_loss"]


def test_launcher_gives_the_plain_losses(tiny_assets, plain_run, tmp_path):
    """`python -m accelerate_roundpipe.run run_clm-style.py ARGS` in a fresh process (max_grad_norm 1.0 on, sync
    optimizer): the 20 logged losses and gradient norms, and the evaluation loss, are the plain run's."""
    out = str(tmp_path / "rp")
    run_subprocess([sys.executable, "-m", "accelerate_roundpipe.run", TRAINER_SCRIPT,
                    *trainer_args(tiny_assets, out, 20, "--do_eval")], subprocess_env(str(tmp_path), ROUNDPIPE_ENV))
    ours, theirs = trainer_log(out), trainer_log(plain_run)
    assert_close_lists([e["loss"] for e in ours], [e["loss"] for e in theirs], "losses")
    assert_close_lists([e["grad_norm"] for e in ours], [e["grad_norm"] for e in theirs], "gradient norms", 1e-4)
    # Same numbers prove nothing about who trained (the sync optimizer gives the plain losses): RoundPipeTrainer
    # adds its live metrics to every log after the first.
    assert all("roundpipe/tokens_per_s" in e for e in ours[1:]) and not any("roundpipe/tokens_per_s" in e
                                                                             for e in theirs)
    assert abs(_eval_loss(out) - _eval_loss(plain_run)) < 1e-5
    assert os.path.isfile(os.path.join(out, "model.safetensors"))  # trainer.save_model()


def test_flags_reach_the_engine_and_accumulation_4(tiny_assets, tmp_path):
    """Through the launcher, the script's HfArgumentParser accepts --roundpipe_* flags (they beat ROUNDPIPE_*);
    with gradient accumulation 4 the losses are the plain run's."""
    plain, ours = str(tmp_path / "plain"), str(tmp_path / "rp")
    extra = ("--gradient_accumulation_steps", "4")
    run_in_process(TRAINER_SCRIPT, trainer_args(tiny_assets, plain, 6, *extra), roundpipe=False)
    run_in_process(TRAINER_SCRIPT, trainer_args(tiny_assets, ours, 6, *extra, "--roundpipe_async_optimizer", "false",
                                                "--roundpipe_num_microbatches", "1"),
                   roundpipe=True, env={**ROUNDPIPE_ENV, "ROUNDPIPE_ASYNC_OPTIMIZER": "true"})
    assert_close_lists([e["loss"] for e in trainer_log(ours)], [e["loss"] for e in trainer_log(plain)],
                       "accumulation 4, RoundPipe vs plain")
