"""[Note: the measured pass's pinned blocks released]: once the measured pass has finished and the plan changed what
the passes save, torch's cached page-locked blocks that nobody holds go back, once; never without an accelerator."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from accelerate_roundpipe import RoundPipe, RoundPipeConfig
from accelerate_roundpipe.runtime.devices.pinned import release_cached_pinned_memory
from accelerate_roundpipe.runtime.execution import measured_plan

from toy_models import batch, tied_model


def test_the_cache_is_emptied_only_where_an_accelerator_is_in_use():
    emptied = []
    present = SimpleNamespace(is_available=lambda: True, empty_host_cache=lambda: emptied.append(1))
    assert release_cached_pinned_memory(present) and emptied == [1]
    absent = SimpleNamespace(is_available=lambda: False, empty_host_cache=lambda: emptied.append(1))
    assert not release_cached_pinned_memory(absent) and emptied == [1]
    older = SimpleNamespace(is_available=lambda: True)  # torch 2.11: only the private name
    assert release_cached_pinned_memory(older, SimpleNamespace(_host_emptyCache=lambda: emptied.append(2)))
    assert emptied == [1, 2]
    assert not release_cached_pinned_memory(older, SimpleNamespace())  # neither: nothing to call
    if not torch.cuda.is_available():  # this machine: nothing to release, nothing raised
        assert not release_cached_pinned_memory()


def test_the_re_plan_after_the_measured_pass_releases_once(monkeypatch):
    calls = []
    monkeypatch.setattr(measured_plan, "release_cached_pinned_memory", lambda: calls.append(1))
    engine = RoundPipe(tied_model(), RoundPipeConfig(devices=["cpu", "cpu"], summary=False, plan="measured"))
    try:
        first = engine._launch.partition
        for step in range(3):
            x, mask, y = batch(rows=8, seed=step)
            engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy)
        replanned = engine._launch.partition != first or engine._plan.chosen_microbatches is not None
        assert calls == ([1] if replanned else [])
        assert replanned  # the toy model's measured plan differs from the unplanned one: the release ran
    finally:
        engine.close()
