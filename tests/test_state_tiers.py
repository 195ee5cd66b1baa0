"""One owner for where a trainable bucket's optimizer state lives (issue 33 item 1): the bucket's tier
([Note: state tiers]). The placement is branched on in at most 3 runtime files (the tiers, the placement that
registers them, the bucket that holds one), and the runtime asks the tier, around each step, what a disk tier will
need: the order its buckets are stepped in, then before and after each bucket's step."""

from __future__ import annotations

import ast
from pathlib import Path

import torch
from torch import nn

from accelerate_roundpipe import RoundPipe, RoundPipeConfig
from accelerate_roundpipe.runtime.state.tiers import HOST, DeviceTier, StateTier

from toy_models import batch, tied_model

RUNTIME = Path(__file__).resolve().parents[1] / "accelerate_roundpipe" / "runtime"
TIER_NAMES = {"HostTier", "DeviceTier", "HOST"}


def _branches_on_placement(path: Path) -> bool:
    """Whether `path` reads or writes a `.home` (a bucket's or a place's home) or names a tier class."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr == "home":
            return True
        if isinstance(node, ast.Name) and node.id in TIER_NAMES:
            return True
        if isinstance(node, ast.alias) and node.name in TIER_NAMES:
            return True
    return False


def test_placement_is_branched_on_in_at_most_three_runtime_files():
    """Before the tiers: 8 runtime files branched on `Bucket.home` (or a place's home)."""
    files = sorted(str(p.relative_to(RUNTIME)) for p in RUNTIME.rglob("*.py") if _branches_on_placement(p))
    assert len(files) <= 3, files
    assert set(files) <= {"state/tiers.py", "state/placement.py", "state/bucket.py"}, files


class RecordingTier(DeviceTier):
    """A device tier that records the hooks a disk tier will use."""

    def __init__(self, device: torch.device, calls: list) -> None:
        super().__init__(device)
        self.calls = calls

    def will_step(self, buckets):
        self.calls.append(("will_step", [b.index for b in buckets]))

    def before_step(self, bucket):
        self.calls.append(("before", bucket.index))

    def after_step(self, bucket):
        self.calls.append(("after", bucket.index))


def _engine(placement: str, lagged: bool = False) -> RoundPipe:
    config = RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=2, async_optimizer=lagged, summary=False,
                             optimizer_placement=placement)
    return RoundPipe(tied_model(), config)


def test_buckets_hold_their_tier():
    """Host buckets hold the one host tier; device buckets one tier per home device, which says where they live."""
    for placement in ("host", "device"):
        engine = _engine(placement)
        try:
            engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-2))
            tiers = {id(b.tier): b.tier for b in engine.host_store.trainable_buckets}
            assert len(tiers) == 1
            (tier,) = tiers.values()
            if placement == "host":
                assert tier is HOST and tier.device is None and tier.track == "optimizer"
            else:
                assert isinstance(tier, DeviceTier) and tier.device == torch.device("cpu")
                assert tier.track == "optimizer cpu" and tier.steps_exactly_when_lagged and not tier.crosses_pcie
            for bucket in engine.host_store.trainable_buckets:
                assert bucket.home == tier.device
        finally:
            engine.close()


def test_the_step_announces_its_order_and_wraps_each_bucket():
    """Each step tells the tier its buckets in the order it takes them (backward order; bottom-up after a clip),
    then calls before and after each bucket's step, in its gradient turn. Exact and lagged (a device tier steps
    exactly under the lag)."""
    for lagged in (False, True):
        engine = _engine("device", lagged)
        try:
            optimizer = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-2))
            calls: list = []
            tier = RecordingTier(torch.device("cpu"), calls)
            for bucket in engine.host_store.trainable_buckets:
                bucket.tier = tier
            order = [b.index for b in engine.host_store.trainable_in_backward_order]
            for clip in (False, True):
                calls.clear()
                x, mask, y = batch(rows=8, seed=1)
                engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy)
                if clip:
                    optimizer.clip_grad_norm_(1.0)
                optimizer.step()
                optimizer.zero_grad()
                engine.synchronize()
                announced = order[::-1] if clip else order
                assert calls[0] == ("will_step", announced), calls
                steps = calls[1:]
                assert sorted(i for kind, i in steps if kind == "before") == sorted(order)
                assert sorted(i for kind, i in steps if kind == "after") == sorted(order)
                for index in order:  # each bucket's after follows its before
                    assert steps.index(("before", index)) < steps.index(("after", index))
        finally:
            engine.close()


def test_a_tier_defaults_to_the_hosts_answers():
    """A new tier starts from the host's answers and no-op hooks."""
    tier = StateTier()
    assert tier.device is None and tier.step_group is None and tier.stale_compute_after_exact_step
    assert tier.crosses_pcie and tier.optim_resident and not tier.steps_exactly_when_lagged
    assert not tier.grads_stay_on(torch.device("cpu"))
