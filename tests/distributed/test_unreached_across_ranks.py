"""[Note: parameters no rank reaches] (`runtime/distribution/shards.py`): under data parallelism a parameter that no
rank's loss reached is not stepped (plain torch on the global batch leaves its `.grad` None, and DDP leaves a
globally unused parameter's `.grad` untouched), one that some ranks reached is stepped with the sum of the ranks'
gradients, and a bucket that gets no gradient on one rank still meets its peers' collectives. Float64, two
processes over gloo, against plain torch on the global batch."""

from __future__ import annotations

import pytest
import ranks
import unreached_scenarios
from ranks import run_ranks

SETTINGS = {"exact": {}, "exact clipped": {"clip": 0.5}, "lagged clipped": {"async_optimizer": True, "clip": 0.5},
            "host": {"optimizer_placement": "host"}}


@pytest.fixture(scope="module")
def in_turn():
    """Every case's expected weights, and its two-rank run: the cases in turn on one pair of processes (one start
    for all); each test reads its own (`ranks.ran`)."""
    expected = {case: unreached_scenarios.one_process_weights(2, settings) for case, settings in SETTINGS.items()}
    calls = [(case, unreached_scenarios.trains_as_one_process, (settings, expected[case]))
             for case, settings in SETTINGS.items()]
    return expected, run_ranks(ranks.in_turn, 2, calls, timeout_s=300)


@pytest.mark.parametrize("case", list(SETTINGS))
def test_parameters_reached_by_some_ranks_or_none(in_turn, case):
    expected, reports = in_turn
    assert all(report["weights"] == sorted(expected[case]) for report in ranks.ran(reports, case))


def test_the_flags_cover_each_case():
    """Plain torch stepped the side branches on 3 of the 5 steps (reached by one rank, both, both) and the
    skippable layers on 4 (both, one, one, both): the cases the test above checks are all there."""
    model, optimizer = unreached_scenarios.reference(2)
    steps = {n: int(optimizer.state[p]["step"]) for n, p in model.named_parameters() if p in optimizer.state}
    assert steps["0.side.weight"] == 3 and steps["1.proj.weight"] == 4 and steps["0.main.weight"] == 5
