"""[Note: parameters no rank reaches] (`runtime/distribution/shards.py`): under data parallelism a parameter that no
rank's loss reached is not stepped (plain torch on the global batch leaves its `.grad` None, and DDP leaves a
globally unused parameter's `.grad` untouched), one that some ranks reached is stepped with the sum of the ranks'
gradients, and a bucket that gets no gradient on one rank still meets its peers' collectives. Float64, two
processes over gloo, against plain torch on the global batch."""

from __future__ import annotations

import pytest
import unreached_scenarios
from ranks import run_ranks


@pytest.mark.parametrize("settings", [{}, {"clip": 0.5}, {"async_optimizer": True, "clip": 0.5},
                                      {"optimizer_placement": "host"}],
                         ids=["exact", "exact clipped", "lagged clipped", "host"])
def test_parameters_reached_by_some_ranks_or_none(settings):
    expected = unreached_scenarios.one_process_weights(2, settings)
    reports = run_ranks(unreached_scenarios.trains_as_one_process, 2, settings, expected, timeout_s=150)
    assert all(report["weights"] == sorted(expected) for report in reports)


def test_the_flags_cover_each_case():
    """Plain torch stepped the side branches on 3 of the 5 steps (reached by one rank, both, both) and the
    skippable layers on 4 (both, one, one, both): the cases the test above checks are all there."""
    model, optimizer = unreached_scenarios.reference(2)
    steps = {n: int(optimizer.state[p]["step"]) for n, p in model.named_parameters() if p in optimizer.state}
    assert steps["0.side.weight"] == 3 and steps["1.proj.weight"] == 4 and steps["0.main.weight"] == 5
