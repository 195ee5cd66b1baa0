"""[Note: shards of another world size]: the optimizer shards of every rank of a data-parallel run join into the
state one process would have, whatever the number of ranks that cut them. One process here: the ranks' shards are
cut by `ShardedSteps` over a stand-in group (uneven ranges, three ranks), as the ranks of a run would save them."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn

from accelerate_roundpipe import RoundPipe, RoundPipeConfig
from accelerate_roundpipe.runtime.distribution.collectives import DataParallelError
from accelerate_roundpipe.runtime.distribution.shards import ShardedSteps, full_state_of_shards

from toy_models import batch, tied_model


@dataclass
class StandInGroup:
    """What `ShardedSteps` reads of a `DataParallelGroup`: rank r of `world_size` owns the r-th ceil(n/world) run of
    elements (the last one shorter, some empty)."""

    rank: int
    world_size: int

    def shard_range(self, numel: int) -> tuple[int, int]:
        chunk = -(-numel // self.world_size)
        return min(numel, self.rank * chunk), min(numel, (self.rank + 1) * chunk)


def trained_engine(steps: int = 2):
    engine = RoundPipe(tied_model(num_blocks=2), RoundPipeConfig(devices=["cpu"], summary=False, seed=0))
    params = list(engine.parameters())
    optimizer = engine.wrap_optimizer(torch.optim.AdamW(
        [{"params": params[::2]}, {"params": params[1::2], "weight_decay": 0.0}], lr=1e-2, weight_decay=0.1))
    for k in range(steps):
        x, mask, y = batch(rows=6, seed=k)
        engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy)
        optimizer.step()
        optimizer.zero_grad()
    engine.synchronize()
    return engine, optimizer


def shards_of(engine, optimizer, world_size: int) -> list[dict]:
    full = optimizer.state_dict()
    shards = []
    for rank in range(world_size):
        steps = ShardedSteps(optimizer.inner, engine.host_store, StandInGroup(rank, world_size))
        steps.load_state_dict(full)
        shards.append(steps.state_dict())
    return shards


def assert_same_state(actual: dict, expected: dict) -> None:
    assert actual["state"].keys() == expected["state"].keys()
    for index, values in expected["state"].items():
        assert actual["state"][index].keys() == values.keys()
        for key, value in values.items():
            torch.testing.assert_close(actual["state"][index][key], value, rtol=0, atol=0, msg=f"{index}.{key}")
    assert [{k: v for k, v in g.items() if k != "params"} for g in actual["param_groups"]] == \
        [{k: v for k, v in g.items() if k != "params"} for g in expected["param_groups"]]


def test_every_ranks_shard_joins_into_the_one_process_state_and_loads():
    engine, optimizer = trained_engine()
    full = optimizer.state_dict()
    assert all(int(v["step"]) == 2 for v in full["state"].values())
    shards = shards_of(engine, optimizer, world_size=3)
    assert_same_state(full_state_of_shards(list(reversed(shards)), engine.host_store, optimizer.inner), full)

    fresh, fresh_optimizer = trained_engine(steps=0)
    fresh_optimizer.load_shards(shards)
    assert_same_state(fresh_optimizer.state_dict(), full)
    engine.close()
    fresh.close()


def test_an_incomplete_set_of_shards_is_refused():
    engine, optimizer = trained_engine(steps=1)
    shards = shards_of(engine, optimizer, world_size=3)
    with pytest.raises(DataParallelError, match=r"ranks \[0, 2\].*every rank of one run"):
        optimizer.load_shards([shards[0], shards[2]])
    with pytest.raises(ValueError, match="not a shard"):
        optimizer.load_shards([shards[0], optimizer.state_dict()])
    engine.close()
