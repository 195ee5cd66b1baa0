"""`accelerator.save_state` under two processes (issue 31 item 3, [Note: tagged agreements]): saved on every rank it
writes each rank's optimizer shard and resumes exactly; under `if accelerator.is_main_process:` rank 0 raises at once
(not after `wait_timeout_s`), saying that every process must call it, and writes nothing, while rank 1 goes through
its `wait_for_everyone()`; with nothing held per rank (no optimizer) the main process saves alone, as under plain
accelerate."""

from __future__ import annotations

import os

import pytest
import save_state_scenarios as scenarios
import torch
from ranks import run_ranks

WAIT_TIMEOUT_S = 60.0  # what the old agreement waited before blaming rank 1
FAST_S = 10.0  # a fraction of it: the refusal needs no timeout


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("save_state")
    every_rank, main_only = str(root / "every_rank"), str(root / "main_only")
    reports = run_ranks(scenarios.train_then_save, 2, every_rank, main_only, WAIT_TIMEOUT_S, timeout_s=300)
    return every_rank, reports


def test_save_state_under_is_main_process_fails_at_once_and_writes_nothing(saved):
    _, (first, second) = saved
    main_only = first["main_only"]
    assert main_only["error"] is not None and main_only["error"].startswith("RanksApartError: "), main_only
    assert "call accelerator.save_state(...) on every process" in main_only["error"], main_only
    assert "optimizer state is its own shard" in main_only["error"] and "rank 1 is in no agreement" in \
        main_only["error"], main_only
    assert main_only["elapsed"] < FAST_S, main_only
    assert main_only["written"] is None  # no directory at all, not a partial checkpoint
    # Rank 1 was in `wait_for_everyone()` and is let through it.
    assert second["main_only"]["error"] is None and second["main_only"]["elapsed"] < FAST_S, second


def test_save_state_on_every_rank_writes_every_shard_and_resumes_exactly(saved, tmp_path):
    every_rank, (first, _) = saved
    files = set(os.listdir(every_rank))
    assert {"model.safetensors", "optimizer.rank0-of-2.bin", "optimizer.rank1-of-2.bin",
            "roundpipe_engine_state.rank0-of-2.json", "roundpipe_engine_state.rank1-of-2.json"} <= files, files
    resumed = run_ranks(scenarios.resume, 2, every_rank, WAIT_TIMEOUT_S, timeout_s=300)[0]
    uninterrupted = first["losses"][scenarios.SAVE_AT:]
    assert len(resumed) == len(uninterrupted) == scenarios.STEPS - scenarios.SAVE_AT
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(uninterrupted), rtol=1e-6, atol=0)


def test_save_state_with_nothing_held_per_rank_is_saved_by_the_main_process_alone(tmp_path):
    directory = str(tmp_path / "state")
    first, second = run_ranks(scenarios.evaluate_then_save, 2, directory, WAIT_TIMEOUT_S, timeout_s=300)
    assert first["error"] is None and first["elapsed"] < FAST_S, first
    assert second["error"] is None, second
    assert {"model.safetensors", "random_states_0.pkl", "roundpipe_engine_state.rank0-of-2.json"} <= \
        set(first["written"]), first
