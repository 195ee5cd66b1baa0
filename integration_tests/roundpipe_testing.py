"""Helpers for the integration tests: running the stock example scripts (in this process or launched), reading
their losses, and the staleness-1 reference optimizer."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from unittest import mock

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOOP_SCRIPT = os.path.join(REPO, "examples", "stock_accelerate_clm.py")
TRAINER_SCRIPT = os.path.join(REPO, "examples", "stock_trainer_clm.py")
ATOL = 1e-5

# Two CPU workers, two micro-batches per step, the optimizer stepped without lag unless a test says otherwise.
ROUNDPIPE_ENV = {"ROUNDPIPE_DEVICES": "cpu,cpu", "ROUNDPIPE_NUM_MICROBATCHES": "2",
                 "ROUNDPIPE_ASYNC_OPTIMIZER": "false"}


def data_args(assets: str) -> list[str]:
    return ["--config_name", assets, "--tokenizer_name", assets, "--train_file", os.path.join(assets, "train.txt"),
            "--validation_file", os.path.join(assets, "validation.txt")]


def loop_args(assets: str, output_dir: str, steps: int = 20, *extra: str) -> list[str]:
    return [*data_args(assets), "--output_dir", output_dir, "--max_train_steps", str(steps),
            "--per_device_train_batch_size", "2", "--learning_rate", "3e-3", "--max_grad_norm", "1.0", *extra]


def trainer_args(assets: str, output_dir: str, steps: int = 20, *extra: str) -> list[str]:
    return [*data_args(assets), "--output_dir", output_dir, "--do_train", "--max_steps", str(steps),
            "--per_device_train_batch_size", "2", "--learning_rate", "3e-3", "--logging_steps", "1",
            "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true", "--use_cpu", "true",
            "--dataloader_pin_memory", "false", "--seed", "0", *extra]


def reset_accelerate_state() -> None:
    """Each in-process run starts like a fresh process (accelerate keeps process-wide singletons)."""
    from accelerate_roundpipe.compat.accelerate_internals import reset_accelerate_state as reset

    reset()


def run_in_process(script: str, argv: list[str], roundpipe: bool, env: dict[str, str] | None = None) -> None:
    """`python script.py ARGS` (roundpipe=False) or `python -m accelerate_roundpipe.run script.py ARGS`, in-process."""
    from accelerate_roundpipe.launch.run_script import run_script

    reset_accelerate_state()
    saved_argv = sys.argv
    try:
        with mock.patch.dict(os.environ, env or {}):
            if roundpipe:
                run_script([script, *argv])
            else:
                sys.argv = [script, *argv]
                runpy.run_path(script, run_name="__main__")
    finally:
        sys.argv = saved_argv
        reset_accelerate_state()


def subprocess_env(tmp_dir: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """A clean environment for launched runs: offline, one intra-op thread, a private HF home (so no user-level
    accelerate config is picked up), no inherited ROUNDPIPE_* settings. Python's fault handler is on: a run that
    aborts (the rare SIGABRT at the exit of a healthy two-process run, see the closing notes) then prints every
    thread's stack into the output the failing assertion shows."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROUNDPIPE_")}
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HOME": os.path.join(tmp_dir, "hf_home"),
                "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                "PYTHONFAULTHANDLER": "1", "PYTHONPATH": REPO + os.pathsep + env.get("PYTHONPATH", "")})
    env.update(extra or {})
    return env


def run_subprocess(command: list[str], env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess:
    result = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return result


def run_subprocesses(runs: list[tuple[list[str], dict[str, str]]], timeout: float = 240,
                     ) -> list[subprocess.CompletedProcess]:
    """`run_subprocess` for each (command, env) of independent runs, all started at once (most of a launched run is
    one process importing transformers on one core: two runs side by side use both cores). Each must succeed within
    `timeout`; their results in order."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:
        futures = [pool.submit(run_subprocess, command, env, timeout) for command, env in runs]
        return [future.result() for future in futures]


def loop_losses(output_dir: str) -> list[float]:
    with open(os.path.join(output_dir, "step_losses.json")) as f:
        return json.load(f)


def trainer_log(output_dir: str) -> list[dict]:
    with open(os.path.join(output_dir, "trainer_state.json")) as f:
        return [entry for entry in json.load(f)["log_history"] if "loss" in entry]


def assert_close_lists(actual: list[float], expected: list[float], what: str, atol: float = ATOL) -> None:
    assert len(actual) == len(expected), f"{what}: {len(actual)} values vs {len(expected)}"
    worst = max(abs(a - e) for a, e in zip(actual, expected))
    assert worst <= atol, f"{what}: max difference {worst:.3g} > {atol}\n{actual}\n{expected}"


def staleness_one(optimizer_class: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """A plain-PyTorch reference for `async_optimizer=True`: `optimizer_class` stepping separate master weights,
    while the model computes with the weights from one step earlier (iteration k uses the weights after steps
    0..k-2, the first two iterations the initial weights).

    Built over the model's parameters like any optimizer; at `step()` it takes their gradients (clipped or not),
    steps the masters, and sets the model's weights to the masters as they were before this step.
    """

    class StalenessOne(optimizer_class):
        def __init__(self, params, *args, **kwargs):
            groups = list(params)
            if groups and not isinstance(groups[0], dict):
                groups = [{"params": groups}]
            self.pairs = []
            master_groups = []
            for group in groups:
                masters = []
                for p in group["params"]:
                    master = torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
                    self.pairs.append((master, p))
                    masters.append(master)
                master_groups.append({**group, "params": masters})
            super().__init__(master_groups, *args, **kwargs)

        @torch.no_grad()
        def step(self, closure=None):
            for master, model_param in self.pairs:
                master.grad = None if model_param.grad is None else model_param.grad.clone()
            before = [master.detach().clone() for master, _ in self.pairs]
            super().step()
            for (_, model_param), value in zip(self.pairs, before):
                model_param.copy_(value)

        def zero_grad(self, set_to_none: bool = True):
            super().zero_grad(set_to_none)
            for _, model_param in self.pairs:
                model_param.grad = None

    StalenessOne.__name__ = f"StalenessOne{optimizer_class.__name__}"
    return StalenessOne
