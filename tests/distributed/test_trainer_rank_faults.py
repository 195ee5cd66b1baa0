"""Two `RoundPipeTrainer` ranks in spawned processes (gloo, CPU workers): a rank that stalls or dies makes the other
raise within `wait_timeout_s` (plus a margin), naming the collective it waited in, in the Trainer's own collectives
(the per-step gathers on the default process group) as in the staged checkpoint's agreement; a failed save leaves
no `tmp-checkpoint-N` behind ([Note: staged checkpoints], [Note: collective timeouts])."""

from __future__ import annotations

import pytest
import trainer_scenarios
from ranks import Exited, run_ranks_side_by_side

WAIT_TIMEOUT_S = 8.0
MARGIN_S = 12.0  # gloo's own slack and a busy two-core machine; far below the 1800 s default group timeout
WHERE = ("step", "save", "killed in save")


@pytest.fixture(scope="module")
def stalls(tmp_path_factory) -> dict[str, list]:
    """Each fault's pair of ranks, the three pairs side by side (independent runs: their imports share the cores,
    and their waits for the timeout overlap): where -> what rank 0 and rank 1 left."""
    runs = [(trainer_scenarios.a_rank_stalls, 2, (str(tmp_path_factory.mktemp("stall")), where, WAIT_TIMEOUT_S), 150)
            for where in WHERE]
    return dict(zip(WHERE, run_ranks_side_by_side(*runs)))


def _stall(stalls, where: str) -> dict:
    first, second = stalls[where]
    assert isinstance(second, Exited) and second.code == 3, second
    assert first["error"] is not None and first["elapsed"] is not None, first
    assert first["elapsed"] < WAIT_TIMEOUT_S + MARGIN_S, first
    return first


@pytest.mark.slow
def test_a_rank_stalled_after_a_step_stops_the_other_in_the_trainers_gather(stalls):
    first = _stall(stalls, "step")
    # after step 2 rank 0 logs: the Trainer gathers the loss on the default process group, which rank 1 never joins
    assert "all-gather of the training loss it logs" in first["error"], first
    assert "peer (rank 1)" in first["error"] and "wait_timeout_s" in first["error"], first


@pytest.mark.slow
@pytest.mark.parametrize("where", ["save", "killed in save"])
def test_a_rank_lost_during_a_save_stops_the_other_and_removes_the_staged_checkpoint(stalls, where):
    first = _stall(stalls, where)
    assert "checkpoint-2" in first["error"] and "rank 1" in first["error"], first
    assert "wait_timeout_s" in first["error"], first
    assert not [f for f in first["files"] if f.startswith("tmp-") or f == "checkpoint-2"], first
