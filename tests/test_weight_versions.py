"""One owner for which copy of a bucket holds which weights ([Note: weight versions] in
`runtime/state/weight_versions.py`): the transitions, and no write from outside."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from accelerate_roundpipe import RoundPipe, RoundPipeConfig
from accelerate_roundpipe.runtime.state.weight_versions import WeightVersions


def test_the_transitions_of_a_lagged_and_an_exact_step():
    compute, optim = torch.zeros(4), torch.zeros(4, dtype=torch.float64)
    versions = WeightVersions(compute, optim)
    versions.loaded_into_both()
    assert not versions.changed_outside()
    optim.add_(1.0)  # a lagged step writes the optimizer copy; readers keep the compute copy
    versions.step_written(current_for_readers=False)
    assert not versions.changed_outside() and versions.current() is compute and versions.steps.current == 0
    versions.show_newest()  # a look: the newest weights for whoever looks, the old ones for the next pass
    assert torch.equal(compute, torch.ones(4)) and torch.equal(versions.current(), torch.zeros(4))
    assert versions.current(newest=True) is compute and versions.steps.compute == 1
    versions.write_back()  # the next pass has read its version: the stash goes
    assert versions.stash is None and versions.current() is compute
    optim.add_(1.0)  # an exact step: readers read the optimizer copy itself
    versions.reserve_new_version()
    versions.step_written(current_for_readers=True)
    assert versions.current() is optim and versions.steps.current == 2 and versions.steps.compute == 1
    assert versions.new_versions_reserved == 1
    versions.write_back()
    assert not versions.current_in_optim and torch.equal(compute, torch.full((4,), 2.0))
    optim.add_(1.0)  # a write the engine did not make
    assert versions.changed_outside()


def test_no_one_but_the_versions_writes_a_buckets_version_fields():
    engine = RoundPipe(nn.Sequential(nn.Linear(2, 2)), RoundPipeConfig(devices=["cpu"]))
    try:
        bucket = engine.host_store.trainable_buckets[0]
        for name, value in (("current_in_optim", True), ("stash", None), ("new_versions_reserved", 1),
                            ("steps", None)):
            with pytest.raises(AttributeError):
                setattr(bucket, name, value)
    finally:
        engine.close()
