"""[Note: shared frozen weights] (`runtime/execution/residency.py`): a task whose frozen buckets a running or
prefetched task on the same device has uploaded reads that task's flats instead of uploading them again, and a
task behind it may be prefetched when the device's memory allows; training stays equal to plain torch (float64 on
CPU workers, also through the stream model, which checks CUDA's ordering), and a flat uploaded before the user
changed one of its frozen parameters in place is not shared with a later pass."""

from __future__ import annotations

import copy
import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from accelerate_roundpipe import RoundPipe, RoundPipeConfig
from accelerate_roundpipe.runtime.common import faults
from accelerate_roundpipe.runtime.devices import factory
from accelerate_roundpipe.runtime.devices.factory import make_device
from accelerate_roundpipe.runtime.devices.stream_model import StreamModelDevice
from accelerate_roundpipe.runtime.execution.residency import ParamResidency, TaskParams

WIDTH = 16


class Adapted(nn.Module):
    """A frozen linear map with a small trainable one beside it (LoRA's shape of the problem)."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(WIDTH, WIDTH, dtype=torch.float64)
        self.base.requires_grad_(False)
        self.down = nn.Linear(WIDTH, 1, bias=False, dtype=torch.float64)
        self.up = nn.Linear(1, WIDTH, bias=False, dtype=torch.float64)
        nn.init.normal_(self.up.weight, std=0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.base(x) + self.up(self.down(x)))


def _layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(Adapted() for _ in range(6)))


def _batch(step: int) -> torch.Tensor:
    return torch.randn(6, WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(step))


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().sum()


def _slow_tasks(name: str) -> None:
    if name == "worker.task":  # the caller queues the next pass while the last backward stages still run
        time.sleep(0.02)


def _train(look_ahead: str | None, monkeypatch, steps: int = 4):
    plain = _layers()
    model = copy.deepcopy(plain)
    engine = RoundPipe(model, RoundPipeConfig(devices=["cpu"], num_microbatches=2, forward_stages=[2, 2],
                                              backward_stages=[2, 2, 2], summary=False))
    if look_ahead:  # what a measured plan leaves a running task on a GPU; CPU workers count no memory
        engine._launch.plan.lookahead_limit_bytes = 1 << 40
    if look_ahead == "part":  # room for one frozen bucket: the rest of the task's flats come when it is taken
        one = max(b.compute.numel() * b.compute.element_size() for b in engine._store.buckets if not b.trainable)
        real_room = ParamResidency._look_ahead_room
        monkeypatch.setattr(ParamResidency, "_look_ahead_room",
                            lambda self, job, behind: min(real_room(self, job, behind), one))
    plain_opt = torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], lr=1e-2)
    optimizer = engine.wrap_optimizer(torch.optim.AdamW([p for p in engine.parameters() if p.requires_grad],
                                                        lr=1e-2))
    losses, plain_losses = [], []
    try:
        with faults.injected(_slow_tasks):
            for step in range(steps):
                x = _batch(step)
                plain_loss = _loss(plain(x))
                plain_loss.backward()
                plain_opt.step()
                plain_opt.zero_grad()
                plain_losses.append(plain_loss.detach())
                losses.append(engine.forward_backward(x, loss_fn=_loss, loss_reduction="sum"))
                optimizer.step()
                optimizer.zero_grad()
        engine.synchronize()
        residency = engine._dispatch.workers[0].residency
        counts = residency.shared, residency.looked_ahead, residency.allocated_late
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        engine.close()
    return losses, plain_losses, weights, dict(plain.named_parameters()), counts


@pytest.mark.parametrize("look_ahead", [None, "whole", "part"], ids=["next task", "two ahead", "two ahead, part"])
@pytest.mark.parametrize("device", ["cpu", "stream model"])
def test_shared_frozen_flats_train_as_plain_torch(look_ahead, device, monkeypatch):
    if device == "stream model":
        monkeypatch.setattr(factory, "cpu_device_class", StreamModelDevice)
    losses, plain_losses, weights, plain_weights, (shared, looked_ahead, late) = _train(look_ahead, monkeypatch)
    assert shared > 0  # the first forward stage of each later pass took the last backward stage's frozen flats
    assert (looked_ahead > 0) == bool(look_ahead)
    assert (late > 0) == (look_ahead == "part")  # the flats a partial look-ahead left out, given at the take
    for step, (loss, plain) in enumerate(zip(losses, plain_losses, strict=True)):
        torch.testing.assert_close(loss, plain, rtol=1e-12, atol=0, msg=f"loss of step {step}")
    for name, weight in weights.items():
        torch.testing.assert_close(weight, plain_weights[name].detach(), rtol=1e-12, atol=1e-14, msg=name)


def test_a_frozen_edit_counts_its_bucket_generation_up_at_the_next_pass():
    engine = RoundPipe(_layers(), RoundPipeConfig(devices=["cpu"], num_microbatches=2, summary=False))
    try:
        store = engine._store
        frozen = [b for b in store.buckets if not b.trainable]
        before = {b.index: b.content_generation for b in frozen}
        engine.forward_backward(_batch(0), loss_fn=_loss, loss_reduction="sum")
        assert {b.index: b.content_generation for b in frozen} == before  # nothing changed: nothing counted
        with torch.no_grad():
            engine.module[3].base.weight.mul_(2.0)
        engine.forward_backward(_batch(1), loss_fn=_loss, loss_reduction="sum")
        counted = {b.index for b in frozen if b.content_generation != before[b.index]}
        edited = {b.index for b in frozen if any(slot.param is engine.module[3].base.weight for slot in b.slots)}
        assert counted == edited and edited
    finally:
        engine.close()


def _job(store, layers: range, tickets):
    """What `ParamResidency` reads of a task's job."""
    return SimpleNamespace(read_tickets=tickets, task=SimpleNamespace(span=SimpleNamespace(layers=layers)),
                           plan=SimpleNamespace(reads_newest=False, lookahead_limit_bytes=0),
                           results=SimpleNamespace(profile=None))


@pytest.fixture
def residency():
    """A residency on a CPU worker of an engine over `_layers()` (the engine not started)."""
    engine = RoundPipe(_layers(), RoundPipeConfig(devices=["cpu"], num_microbatches=2, summary=False))
    try:
        yield ParamResidency(make_device(engine.devices[0].device, 0), engine._store, engine._failure)
    finally:
        engine.close()


def test_a_flat_uploaded_before_a_frozen_edit_is_not_shared_after_it(residency):
    store = residency.store
    frozen = next(b for b in store.buckets if not b.trainable)
    layers = range(min(frozen.layers), max(frozen.layers) + 1)

    def job():
        return _job(store, layers, [(frozen.index, frozen.reads.reserve_read())])

    running = residency.take(job())
    same = residency._allocate(job())
    assert residency.shared == 1 and same.flats[frozen.index].data_ptr() == \
        running.flats[frozen.index].data_ptr() and same.unissued == []
    frozen.content_changed()  # what `FrozenEdits.follow` does at a pass's launch after an edit
    after_edit = residency._allocate(job())
    assert residency.shared == 1 and after_edit.flats[frozen.index].data_ptr() != \
        running.flats[frozen.index].data_ptr()
    residency._issue(after_edit)
    assert torch.equal(after_edit.flats[frozen.index], frozen.compute)
    for params in (running, same, after_edit):
        residency.release(params)
    assert not frozen.reads._open_reads


def test_a_look_ahead_waits_while_the_prefetched_task_has_most_of_its_bytes_to_upload(residency):
    store = residency.store
    frozen = next(b for b in store.buckets if not b.trainable)
    trainable = next(b for b in store.trainable_buckets if set(b.layers) == set(frozen.layers))
    assert trainable.compute.numel() <= frozen.compute.numel() / 3  # the adapter is the smaller part
    windows = {b.index: (0, b.compute.numel()) for b in (frozen, trainable)}
    tickets = [(frozen.index, 0), (trainable.index, 0)]
    adapter_stepped = TaskParams({}, windows, tickets)
    adapter_stepped.mark_issued([(frozen.index, 0)], [None])  # the frozen part is there, the adapter stepped
    assert residency._mostly_issued(adapter_stepped)
    base_stepped = TaskParams({}, windows, tickets)
    base_stepped.mark_issued([(trainable.index, 0)], [None])  # most of its bytes still to come
    assert not residency._mostly_issued(base_stepped)
