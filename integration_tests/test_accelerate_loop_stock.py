"""Way 3 for Accelerate loops: HF's no_trainer-style script, unedited, plain vs on RoundPipe through the launchers.

The script (examples/stock_accelerate_clm.py) uses Accelerator(), prepare, accumulate, backward, clip_grad_norm_,
step, the LR scheduler, save_state / load_state and unwrap_model().save_pretrained.
"""

from __future__ import annotations

import os
import sys
from unittest import mock

import pytest
import torch
from roundpipe_testing import (
    LOOP_SCRIPT,
    ROUNDPIPE_ENV,
    assert_close_lists,
    loop_args,
    loop_losses,
    run_in_process,
    run_subprocess,
    run_subprocesses,
    staleness_one,
    subprocess_env,
)

ASYNC_ENV = {**ROUNDPIPE_ENV, "ROUNDPIPE_ASYNC_OPTIMIZER": "true"}


@pytest.fixture(scope="module")
def plain_run(tiny_assets, tmp_path_factory):
    """The script without RoundPipe: 20 steps, checkpoints at steps 10 and 20."""
    out = str(tmp_path_factory.mktemp("loop_plain"))
    run_in_process(LOOP_SCRIPT, loop_args(tiny_assets, out, 20, "--checkpointing_steps", "10"), roundpipe=False)
    return out


def test_launcher_gives_the_plain_losses_and_weights(tiny_assets, plain_run, tmp_path):
    """`python -m accelerate_roundpipe.run script.py ARGS` in a fresh process, sync optimizer: the same 20 losses."""
    out = str(tmp_path / "rp")
    env = subprocess_env(str(tmp_path), ROUNDPIPE_ENV)
    run_subprocess([sys.executable, "-m", "accelerate_roundpipe.run", LOOP_SCRIPT,
                    *loop_args(tiny_assets, out, 20, "--checkpointing_steps", "10")], env)
    assert_close_lists(loop_losses(out), loop_losses(plain_run), "launcher vs plain losses")
    # unwrap_model(model).save_pretrained(...): the newest weights, a loadable Hugging Face checkpoint.
    from transformers import AutoModelForCausalLM

    ours = AutoModelForCausalLM.from_pretrained(out).state_dict()
    theirs = AutoModelForCausalLM.from_pretrained(plain_run).state_dict()
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, atol=1e-5, rtol=0, msg=name)
    # save_state wrote weights, optimizer, scheduler and RNG like the plain run did, plus the engine's RNG state.
    ours_files = sorted(os.listdir(os.path.join(out, "step_10")))
    assert [f for f in ours_files if not f.startswith("roundpipe_")] == sorted(
        os.listdir(os.path.join(plain_run, "step_10")))
    assert "roundpipe_engine_state.json" in ours_files


def test_async_optimizer_follows_the_staleness_one_reference(tiny_assets, tmp_path):
    """ROUNDPIPE_ASYNC_OPTIMIZER=true: iteration k computes with the weights after steps 0..k-2. The reference is the
    same plain script whose AdamW steps master weights one step ahead of the model's."""
    reference, ours = str(tmp_path / "reference"), str(tmp_path / "rp")
    with mock.patch.object(torch.optim, "AdamW", staleness_one(torch.optim.AdamW)):
        run_in_process(LOOP_SCRIPT, loop_args(tiny_assets, reference), roundpipe=False)
    run_in_process(LOOP_SCRIPT, loop_args(tiny_assets, ours), roundpipe=True, env=ASYNC_ENV)
    assert_close_lists(loop_losses(ours), loop_losses(reference), "async vs staleness-1 reference")


def test_gradient_accumulation_4(tiny_assets, tmp_path):
    """accumulate() with 4 micro-steps per optimizer step: `backward` divides by 4, the engine commits exactly.

    The run crosses an epoch whose last batch has one row: the default micro-batch count (2 x devices, lowered to
    the batch size) follows it. (An explicit ROUNDPIPE_NUM_MICROBATCHES larger than a batch is an error.)"""
    plain, ours = str(tmp_path / "plain"), str(tmp_path / "rp")
    args = ("--gradient_accumulation_steps", "4")
    env = {k: v for k, v in ROUNDPIPE_ENV.items() if k != "ROUNDPIPE_NUM_MICROBATCHES"}
    run_in_process(LOOP_SCRIPT, loop_args(tiny_assets, plain, 8, *args), roundpipe=False)
    run_in_process(LOOP_SCRIPT, loop_args(tiny_assets, ours, 8, *args), roundpipe=True, env=env)
    assert len(loop_losses(ours)) == 32
    assert_close_lists(loop_losses(ours), loop_losses(plain), "accumulation 4, RoundPipe vs plain")


@pytest.mark.parametrize("async_optimizer", ["false", "true"])
def test_resume_from_save_state(tiny_assets, tmp_path, async_optimizer):
    """save_state at step 10, load_state in a new run: steps 11-20 repeat the uninterrupted run's losses."""
    env = {**ROUNDPIPE_ENV, "ROUNDPIPE_ASYNC_OPTIMIZER": async_optimizer}
    full, resumed = str(tmp_path / "full"), str(tmp_path / "resumed")
    run_in_process(LOOP_SCRIPT, loop_args(tiny_assets, full, 20, "--checkpointing_steps", "10"), True, env)
    run_in_process(LOOP_SCRIPT, loop_args(tiny_assets, resumed, 20, "--resume_from_checkpoint",
                                          os.path.join(full, "step_10")), True, env)
    assert_close_lists(loop_losses(resumed), loop_losses(full)[10:], "steps 11-20 after resume")


def test_accelerate_launch_and_the_console_command(tiny_assets, plain_run, tmp_path):
    """`accelerate launch -m accelerate_roundpipe.run ...` and `accelerate-roundpipe launch` with a config file
    carrying a `roundpipe:` section (written by `accelerate-roundpipe config`) both run RoundPipe; a plain
    `accelerate launch` with a RoundPipe-free config keeps working."""
    def env(out: str) -> dict[str, str]:
        return subprocess_env(out + "_home")

    steps = 20  # the LR schedule depends on the step count: compare whole runs
    expected = loop_losses(plain_run)

    # Same losses prove nothing about who trained (the sync optimizer gives the plain losses): a checkpoint at step
    # 10 holds the engine's own state file only when RoundPipe ran.
    checkpoint = ("--checkpointing_steps", "10")

    def ran_roundpipe(out: str) -> bool:
        return os.path.isfile(os.path.join(out, "step_10", "roundpipe_engine_state.json"))

    # The three launches are independent: run side by side (each is mostly one process on one core).
    from accelerate_roundpipe.launch.cli import config_command
    from accelerate_roundpipe.launch.config_file import base_accelerate_config, write_config

    config = config_command(["--config_file", str(tmp_path / "roundpipe_config.yaml"), "--devices", "cpu,cpu",
                             "--num_microbatches", "2", "--async_optimizer", "false"])
    plain_config = str(tmp_path / "plain_config.yaml")
    write_config(base_accelerate_config(use_cpu=True), plain_config)
    launched, console, plain = (str(tmp_path / name) for name in ("accelerate_launch", "console",
                                                                  "plain_accelerate_launch"))
    _, result, _ = run_subprocesses([  # each in an HF home of its own (no shared datasets cache)
        ([sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "-m", "accelerate_roundpipe.run",
          LOOP_SCRIPT, *loop_args(tiny_assets, launched, steps, *checkpoint)], {**env(launched), **ROUNDPIPE_ENV}),
        ([sys.executable, "-m", "accelerate_roundpipe.launch.cli", "launch", "--roundpipe", "--config_file", config,
          LOOP_SCRIPT, *loop_args(tiny_assets, console, steps, *checkpoint)], env(console)),
        ([sys.executable, "-m", "accelerate.commands.launch", "--config_file", plain_config, LOOP_SCRIPT,
          *loop_args(tiny_assets, plain, steps, *checkpoint)], env(plain)),
    ])
    assert_close_lists(loop_losses(launched), expected, "accelerate launch -m accelerate_roundpipe.run")
    assert ran_roundpipe(launched)

    assert_close_lists(loop_losses(console), expected, "accelerate-roundpipe launch --roundpipe")
    assert "RoundPipe on" not in result.stdout  # the script itself never mentions RoundPipe
    assert ran_roundpipe(console)

    assert_close_lists(loop_losses(plain), expected, "plain accelerate launch, RoundPipe installed but not used")
    assert os.path.isdir(os.path.join(plain, "step_10")) and not ran_roundpipe(plain)
