"""Data parallelism end to end through the integrations (issue 17): the stock Accelerate loop and the stock Trainer
script, unedited, launched as TWO processes on this machine (CPU workers, gloo), against ONE process on the whole
batch (each rank gets half of it): the same losses, gradient norms (clipping on), evaluation and saved model, the
optimizer state written per rank, and a resume that repeats the uninterrupted run.

Two CPU processes: `accelerate launch --cpu --num_processes 2` starts ONE process in accelerate 1.15 (without an
mpirun hostfile its CPU path is the simple launcher), so the runs use torchrun, as accelerate's multi-GPU launcher
does, with `ACCELERATE_USE_CPU=true` (the loop's `Accelerator()` then picks MULTI_CPU with gloo) or the Trainer's
`--use_cpu true`. Skipped until the engine supports data parallelism
(`accelerate_roundpipe.runtime.distribution.gloo_exchange`).
Each launched run takes tens of seconds on two cores: the whole file is marked slow.
"""

from __future__ import annotations

import json
import os
import socket
import sys

import pytest
import torch

pytest.importorskip("accelerate_roundpipe.runtime.distribution.gloo_exchange")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "integration_tests"))
from roundpipe_testing import (  # noqa: E402
    LOOP_SCRIPT,
    TRAINER_SCRIPT,
    assert_close_lists,
    loop_args,
    loop_losses,
    run_subprocesses,
    subprocess_env,
    trainer_args,
    trainer_log,
)

pytestmark = pytest.mark.slow

STEPS, SAVE_AT, GLOBAL_BATCH, WORLD = 6, 3, 4, 2
ONE_PROCESS_ENV = {"ROUNDPIPE_DEVICES": "cpu,cpu", "ROUNDPIPE_NUM_MICROBATCHES": "2",
                   "ROUNDPIPE_ASYNC_OPTIMIZER": "false"}
PER_RANK_ENV = {"ROUNDPIPE_DEVICES": "cpu", "ROUNDPIPE_NUM_MICROBATCHES": "1", "ROUNDPIPE_ASYNC_OPTIMIZER": "false",
                "ACCELERATE_USE_CPU": "true"}


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> str:
    from accelerate_roundpipe.tiny.data import write_assets

    return write_assets(str(tmp_path_factory.mktemp("tiny_assets")))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_process_run(script: str, argv: list[str], tmp: str) -> tuple[list[str], dict[str, str]]:
    return ([sys.executable, "-m", "accelerate_roundpipe.run", script, *argv], subprocess_env(tmp, ONE_PROCESS_ENV))


def two_processes_run(script: str, argv: list[str], tmp: str) -> tuple[list[str], dict[str, str]]:
    return ([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(WORLD),
             "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), "-m", "accelerate_roundpipe.run",
             script, *argv], subprocess_env(tmp, PER_RANK_ENV))


def one_and_two_processes(script: str, one: tuple[list[str], str], two: tuple[list[str], str]) -> None:
    """The one-process run (argv, tmp) and the two-process run, independent of each other, side by side."""
    run_subprocesses([one_process_run(script, *one), two_processes_run(script, *two)], timeout=420)


def with_batch(argv: list[str], rows: int) -> list[str]:
    return [*argv, "--per_device_train_batch_size", str(rows), "--per_device_eval_batch_size", str(rows)]


def assert_same_weights(ours: str, reference: str, atol: float = 1e-5) -> None:
    from transformers import AutoModelForCausalLM

    mine = AutoModelForCausalLM.from_pretrained(ours).state_dict()
    for name, tensor in AutoModelForCausalLM.from_pretrained(reference).state_dict().items():
        torch.testing.assert_close(mine[name], tensor, atol=atol, rtol=0, msg=name)


def assert_per_rank_optimizer_files(directory: str, name: str) -> None:
    stem, ext = os.path.splitext(name)
    files = os.listdir(directory)
    assert sorted(f for f in files if f.startswith(stem)) == [f"{stem}.rank{r}-of-{WORLD}{ext}" for r in range(WORLD)]
    assert f"roundpipe_engine_state.rank1-of-{WORLD}.json" in files


# ---------------------------------------------------------------------- the Accelerate loop

@pytest.fixture(scope="module")
def loop_runs(assets, tmp_path_factory):
    one = str(tmp_path_factory.mktemp("loop_one"))
    two = str(tmp_path_factory.mktemp("loop_two"))
    saving = ("--checkpointing_steps", str(SAVE_AT))
    one_and_two_processes(LOOP_SCRIPT, (with_batch(loop_args(assets, one, STEPS, *saving), GLOBAL_BATCH), one),
                          (with_batch(loop_args(assets, two, STEPS, *saving), GLOBAL_BATCH // WORLD), two))
    return one, two


def test_accelerate_loop_two_processes_equal_one_process_on_the_whole_batch(loop_runs):
    one, two = loop_runs
    # Rank 0's losses are the global batch's (the engine's loss), as one process on the whole batch logs them.
    assert_close_lists(loop_losses(two), loop_losses(one), "two processes vs one, loop losses")
    with open(os.path.join(one, "all_results.json")) as f, open(os.path.join(two, "all_results.json")) as g:
        assert json.load(g)["perplexity"] == pytest.approx(json.load(f)["perplexity"], rel=1e-5)
    assert_same_weights(two, one)
    checkpoint = os.path.join(two, f"step_{SAVE_AT}")
    assert_per_rank_optimizer_files(checkpoint, "optimizer.bin")
    assert "model.safetensors" in os.listdir(checkpoint)
    assert {f"random_states_{r}.pkl" for r in range(WORLD)} <= set(os.listdir(checkpoint))


@pytest.fixture(scope="module")
def loop_resumes(assets, loop_runs, tmp_path_factory):
    """The two-process state of `loop_runs` resumed on two processes and on one: independent runs, side by side."""
    _, two = loop_runs
    on_two, on_one = str(tmp_path_factory.mktemp("loop_resumed_two")), str(tmp_path_factory.mktemp("loop_resumed_one"))
    checkpoint = os.path.join(two, f"step_{SAVE_AT}")

    def argv(out: str, rows: int) -> list[str]:
        return with_batch(loop_args(assets, out, STEPS, "--resume_from_checkpoint", checkpoint), rows)
    run_subprocesses([two_processes_run(LOOP_SCRIPT, argv(on_two, GLOBAL_BATCH // WORLD), on_two),
                      one_process_run(LOOP_SCRIPT, argv(on_one, GLOBAL_BATCH), on_one)], timeout=420)
    return on_two, on_one


def test_accelerate_loop_resumes_each_rank_from_its_shard(loop_runs, loop_resumes):
    _, two = loop_runs
    resumed, _ = loop_resumes
    assert_close_lists(loop_losses(resumed), loop_losses(two)[SAVE_AT:], "resumed vs uninterrupted, loop losses")


# ---------------------------------------------------------------------- the Trainer

def trainer_run_args(assets: str, out: str, rows: int, *extra: str) -> list[str]:
    return with_batch(trainer_args(assets, out, STEPS, "--do_eval", "--max_grad_norm", "1.0", *extra), rows)


@pytest.fixture(scope="module")
def trainer_runs(assets, tmp_path_factory):
    saving = ("--save_strategy", "steps", "--save_steps", str(SAVE_AT))
    one = str(tmp_path_factory.mktemp("trainer_one"))
    two = str(tmp_path_factory.mktemp("trainer_two"))
    one_and_two_processes(TRAINER_SCRIPT, (trainer_run_args(assets, one, GLOBAL_BATCH, *saving), one),
                          (trainer_run_args(assets, two, GLOBAL_BATCH // WORLD, *saving), two))
    return one, two


def _eval_loss(output_dir: str) -> float:
    with open(os.path.join(output_dir, "eval_results.json")) as f:
        return json.load(f)["eval_loss"]


def test_trainer_two_processes_equal_one_process_on_the_whole_batch(trainer_runs):
    one, two = trainer_runs
    ours, theirs = trainer_log(two), trainer_log(one)
    assert_close_lists([e["loss"] for e in ours], [e["loss"] for e in theirs], "two processes vs one, Trainer loss")
    assert_close_lists([e["grad_norm"] for e in ours], [e["grad_norm"] for e in theirs], "grad norms (clipping)")
    assert _eval_loss(two) == pytest.approx(_eval_loss(one), rel=1e-5)
    assert_same_weights(two, one)
    assert not [d for d in os.listdir(two) if d.startswith("tmp-")]  # every staged checkpoint was renamed
    checkpoint = os.path.join(two, f"checkpoint-{SAVE_AT}")
    assert_per_rank_optimizer_files(checkpoint, "optimizer.pt")
    files = set(os.listdir(checkpoint))
    assert {"model.safetensors", "scheduler.pt", "trainer_state.json", "rng_state_0.pth", "rng_state_1.pth"} <= files


@pytest.fixture(scope="module")
def trainer_resumes(assets, trainer_runs, tmp_path_factory):
    """The resumes of `trainer_runs`' checkpoints, independent runs side by side: the two-process checkpoint on two
    processes ("two on two") and on one ("two on one"), the one-process checkpoint on two ("one on two")."""
    one, two = trainer_runs
    cases = {"two on two": (two, two_processes_run, GLOBAL_BATCH // WORLD), "two on one": (two, one_process_run,
             GLOBAL_BATCH), "one on two": (one, two_processes_run, GLOBAL_BATCH // WORLD)}
    outs = {name: str(tmp_path_factory.mktemp("trainer_resumed")) for name in cases}
    run_subprocesses([launch(TRAINER_SCRIPT, trainer_run_args(assets, outs[name], batch, "--resume_from_checkpoint",
                                                              os.path.join(source, f"checkpoint-{SAVE_AT}")),
                             outs[name]) for name, (source, launch, batch) in cases.items()], timeout=420)
    return outs


def test_trainer_resumes_each_rank_from_its_shard(trainer_runs, trainer_resumes):
    _, two = trainer_runs
    resumed = trainer_resumes["two on two"]
    after = [e["loss"] for e in trainer_log(resumed) if e["step"] > SAVE_AT]
    assert_close_lists(after, [e["loss"] for e in trainer_log(two) if e["step"] > SAVE_AT], "resumed vs uninterrupted")


@pytest.mark.parametrize("extra", [
    ("--gradient_accumulation_steps", "2"),  # num_items_in_batch spans the window, over both ranks
    ("--label_smoothing_factor", "0.1"),  # the loss from logits: the Trainer's x2 and RoundPipe's 1/2
], ids=["accumulation", "label-smoothing"])
def test_trainer_loss_scaling_paths(assets, tmp_path, extra):
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    one_and_two_processes(TRAINER_SCRIPT, (trainer_run_args(assets, one, GLOBAL_BATCH, *extra), str(tmp_path / "1")),
                          (trainer_run_args(assets, two, GLOBAL_BATCH // WORLD, *extra), str(tmp_path / "2")))
    ours, theirs = trainer_log(two), trainer_log(one)
    assert_close_lists([e["loss"] for e in ours], [e["loss"] for e in theirs], f"losses with {' '.join(extra)}")
    assert_close_lists([e["grad_norm"] for e in ours], [e["grad_norm"] for e in theirs], "grad norms")
    assert_same_weights(two, one)


def _resume_with_another_world_size(trainer_runs, trainer_resumes, written_by: int) -> None:
    """A Trainer checkpoint written by `written_by` processes, resumed by the other count, ends as the uninterrupted
    run of that count does."""
    one, two = trainer_runs
    target, resumed = ((one, trainer_resumes["two on one"]) if written_by == WORLD else
                       (two, trainer_resumes["one on two"]))
    after = [e["loss"] for e in trainer_log(resumed) if e["step"] > SAVE_AT]
    assert_close_lists(after, [e["loss"] for e in trainer_log(target) if e["step"] > SAVE_AT],
                       f"resumed from a checkpoint of {written_by} process(es)")
    assert_same_weights(resumed, target)


def test_trainer_resumes_a_two_process_checkpoint_on_one_process(trainer_runs, trainer_resumes):
    # [Note: shards of another world size]: the two ranks' optimizer shards join into the one-process state, so the
    # resumed run ends as the uninterrupted one-process run (a fresh AdamW state would not).
    _resume_with_another_world_size(trainer_runs, trainer_resumes, written_by=WORLD)


def test_trainer_resumes_a_one_process_checkpoint_on_two_processes(trainer_runs, trainer_resumes):
    # The reverse: each rank cuts its range from the one-process optimizer state.
    _resume_with_another_world_size(trainer_runs, trainer_resumes, written_by=1)


def test_accelerate_loop_resumes_a_two_process_state_on_one_process(loop_runs, loop_resumes):
    # [Note: shards of another world size], through `accelerator.load_state`.
    one, _ = loop_runs
    _, resumed = loop_resumes
    # The losses of the two steps after the checkpoint: the second follows the first update, made with the joined
    # AdamW state. Later ones differ by the script's own doing: its LR scheduler is stepped num_processes times a
    # step over num_processes times the steps, so the two-process scheduler state is two steps a step on one.
    assert_close_lists(loop_losses(resumed)[:2], loop_losses(one)[SAVE_AT:SAVE_AT + 2], "resumed on one process")
