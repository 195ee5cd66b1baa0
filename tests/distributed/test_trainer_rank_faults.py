"""Two `RoundPipeTrainer` ranks in spawned processes (gloo, CPU workers): a rank that stalls or dies makes the other
raise within `wait_timeout_s` (plus a margin), naming the collective it waited in, in the Trainer's own collectives
(the per-step gathers on the default process group) as in the staged checkpoint's agreement; a failed save leaves
no `tmp-checkpoint-N` behind ([Note: staged checkpoints], [Note: collective timeouts])."""

from __future__ import annotations

import pytest
import trainer_scenarios
from ranks import Exited, run_ranks

WAIT_TIMEOUT_S = 8.0
MARGIN_S = 12.0  # gloo's own slack and a busy two-core machine; far below the 1800 s default group timeout


def _stall(tmp_path, where: str) -> dict:
    first, second = run_ranks(trainer_scenarios.a_rank_stalls, 2, str(tmp_path), where, WAIT_TIMEOUT_S,
                              timeout_s=150)
    assert isinstance(second, Exited) and second.code == 3, second
    assert first["error"] is not None and first["elapsed"] is not None, first
    assert first["elapsed"] < WAIT_TIMEOUT_S + MARGIN_S, first
    return first


@pytest.mark.slow
def test_a_rank_stalled_after_a_step_stops_the_other_in_the_trainers_gather(tmp_path):
    first = _stall(tmp_path, "step")
    # after step 2 rank 0 logs: the Trainer gathers the loss on the default process group, which rank 1 never joins
    assert "all-gather of the training loss it logs" in first["error"], first
    assert "peer (rank 1)" in first["error"] and "wait_timeout_s" in first["error"], first


@pytest.mark.slow
@pytest.mark.parametrize("where", ["save", "killed in save"])
def test_a_rank_lost_during_a_save_stops_the_other_and_removes_the_staged_checkpoint(tmp_path, where):
    first = _stall(tmp_path, where)
    assert "checkpoint-2" in first["error"] and "rank 1" in first["error"], first
    assert "wait_timeout_s" in first["error"], first
    assert not [f for f in first["files"] if f.startswith("tmp-") or f == "checkpoint-2"], first
