"""`plan_disk` ([Note: disk tier], [Note: staging slots sized by the plan]): which buckets go to disk under a host
budget, as plain data, on stand-in buckets (an optimizer copy's size and dtype, the layers, the index)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from accelerate_roundpipe.runtime.state.disk_tier import SLOTS, host_state_bytes, layout_of, plan_disk

ADAMW = ("exp_avg", "exp_avg_sq")
LAYER, HEAD = 10_240, 25_600  # elements: eight decoder layers and an untied head 2.5x as large on top


def _buckets() -> list:
    layers = [SimpleNamespace(index=i, layers=range(i, i + 1), optim=torch.empty(LAYER)) for i in range(8)]
    return [*layers, SimpleNamespace(index=8, layers=range(8, 9), optim=torch.empty(HEAD))]


def _host_bytes(buckets) -> int:
    return sum(host_state_bytes(b, len(ADAMW)) for b in buckets)


def test_nothing_moves_when_the_store_fits():
    buckets = _buckets()
    plan = plan_disk(buckets, 0, _host_bytes(buckets), ADAMW)
    assert plan.buckets == () and plan.fits and plan.staging_bytes == 0 and plan.file_bytes == 0


def test_buckets_move_top_down_until_the_rest_and_the_staging_fit():
    buckets = _buckets()[:8]  # the decoder layers alone: one size
    total = _host_bytes(buckets)
    layer_file = layout_of(buckets[0], ADAMW).nbytes
    budget = total * 3 // 4
    plan = plan_disk(buckets, 0, budget, ADAMW)
    assert plan.fits and plan.buckets == tuple(range(7, 7 - len(plan.buckets), -1))
    assert plan.staging_bytes == min(SLOTS, len(plan.buckets)) * layer_file
    moved = sum(b.optim.numel() * 4 * (1 + len(ADAMW)) for b in buckets if b.index in plan.buckets)
    assert plan.host_bytes == total - moved + plan.staging_bytes <= budget
    # one bucket fewer would not have fitted: the plan moves no more than it must
    assert total - moved + LAYER * 12 + plan.staging_bytes > budget


def test_a_bucket_much_larger_than_the_others_stays_when_its_slots_would_cost_more_than_it_saves():
    """On main before 2026-12-05 the head went first and the staging (three slots of the head's file) left no plan
    that fits; without the head, eight layers fit."""
    buckets = _buckets()
    total = _host_bytes(buckets)
    budget = int(total * 0.72)
    plan = plan_disk(buckets, 0, budget, ADAMW)
    assert plan.fits, plan
    assert 8 not in plan.buckets and plan.buckets == tuple(range(7, 7 - len(plan.buckets), -1))  # layers, top down
    assert plan.staging_bytes == SLOTS * layout_of(buckets[0], ADAMW).nbytes


def test_when_nothing_fits_the_plan_leaves_the_fewest_host_bytes():
    from accelerate_roundpipe.runtime.state.disk_tier import _plan_under

    buckets = _buckets()
    sizes = {b.index: layout_of(b, ADAMW).nbytes for b in buckets}
    plan = plan_disk(buckets, 0, 1, ADAMW)
    under_each_cap = [_plan_under(buckets, sizes, cap, 0, 1, len(ADAMW), SLOTS) for cap in set(sizes.values())]
    assert not plan.fits and plan.host_bytes == min(p.host_bytes for p in under_each_cap)
    assert 8 not in plan.buckets  # the head's three slots would cost more than its state
