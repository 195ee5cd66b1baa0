"""[Note: weight buffers reused]: a task's parameter buffers serve a later task of the same shape, the upload into
them ordered on the GPU after the last task that read them; checked on the pool itself and through the engine on
the stream model, where a copy into a reused buffer without that wait raises."""

from __future__ import annotations

import pytest
import torch
from test_stream_model import train

from accelerate_roundpipe.runtime.devices import factory
from accelerate_roundpipe.runtime.devices.device import Device
from accelerate_roundpipe.runtime.devices.stream_model import StreamModelDevice, StreamOrderError
from accelerate_roundpipe.runtime.execution import weight_buffers
from accelerate_roundpipe.runtime.execution.weight_buffers import WeightBuffers


def test_a_buffer_comes_back_for_the_same_size_and_dtype_with_its_event():
    pool = WeightBuffers()
    a, b = torch.empty(8), torch.empty(4, dtype=torch.float64)
    pool.give([a, b], "e1")
    assert pool.take(8, torch.float64) is None and pool.take(4, torch.float32) is None
    got, event = pool.take(8, torch.float32)
    assert got is a and event == "e1"
    assert pool.take(8, torch.float32) is None
    assert pool.take(4, torch.float64)[0] is b


def test_memory_another_tensor_still_views_is_not_taken_back():
    pool = WeightBuffers()
    kept, alone = torch.empty(8), torch.empty(8)
    view = kept[2:5]  # an autograd graph kept past the task would hold such a view
    pool.give([kept, alone], "e")
    assert pool.returned == 1
    assert pool.take(8, torch.float32)[0] is alone and pool.take(8, torch.float32) is None
    del view


def test_idle_buffers_go_back_after_a_few_task_ends_and_beyond_the_largest_task():
    pool = WeightBuffers()
    odd = torch.empty(3)
    pool.give([odd], "e0")
    for i in range(weight_buffers.IDLE_TASKS):
        pool.give([torch.empty(16)], f"e{i + 1}")  # tasks of another size; each one's buffer idles too
    assert pool.take(3, torch.float32) is None  # idle for IDLE_TASKS task ends: handed back to the allocator
    # idle bytes never exceed the largest task's parameter bytes (one buffer of 16 here)
    assert pool.idle_bytes <= 16 * 4
    assert pool.take(16, torch.float32) is not None


def test_training_reuses_buffers_and_each_reuse_waits_for_the_compute_stream(monkeypatch):
    monkeypatch.setattr(factory, "cpu_device_class", StreamModelDevice)
    pools = []
    real_give = WeightBuffers.give

    def give(self, buffers, event):
        if self not in pools:
            pools.append(self)
        return real_give(self, buffers, event)

    monkeypatch.setattr(WeightBuffers, "give", give)
    train("hand-stage", steps=3)  # equal to the plain CPU device: tests/test_stream_model.py
    assert sum(pool.reused for pool in pools) > 0


def test_a_reused_buffer_uploaded_into_without_the_wait_is_refused(monkeypatch):
    monkeypatch.setattr(factory, "cpu_device_class", StreamModelDevice)
    monkeypatch.setattr(Device, "wait_before_uploads", lambda self, after=(): None)  # the copies wait for nothing
    with pytest.raises(Exception) as raised:
        train("hand-stage", steps=3)
    chain, error = [], raised.value
    while error is not None:
        chain.append(error)
        error = error.__cause__ or error.__context__
    assert any(isinstance(e, StreamOrderError) and "reused buffer" in str(e) for e in chain), chain


@pytest.mark.parametrize("give_back", [True, False])
def test_no_idle_buffer_is_held_while_a_task_computes(monkeypatch, give_back):
    """[Note: idle buffers given back at the prefetch]: what the next task's prefetch does not take of the idle
    buffers goes back before the running task computes (the plan sizes activations without them), and buffers are
    still reused. Switched off (`benchmarks/run.py --keep-idle-buffers`), idle buffers are held as before."""
    from accelerate_roundpipe.runtime.execution import residency
    from accelerate_roundpipe.runtime.execution.residency import ParamResidency

    monkeypatch.setattr(residency, "GIVE_BACK_IDLE_AT_PREFETCH", give_back)
    monkeypatch.setattr(factory, "cpu_device_class", StreamModelDevice)
    idle_while_computing, pools = [], set()
    real_await = ParamResidency.await_layer

    def await_layer(self, params, layer_index):
        real_await(self, params, layer_index)
        if not params.unissued:  # the prefetch, deferred until the running task's uploads are issued, has run
            idle_while_computing.append(self.buffers.idle_bytes)
        pools.add(self.buffers)

    monkeypatch.setattr(ParamResidency, "await_layer", await_layer)
    train("hand-stage", steps=3)  # forward stages of 2 and 3 layers, backward stages of 2, 3 and 4
    assert idle_while_computing and (max(idle_while_computing) == 0) == give_back
    assert sum(pool.reused for pool in pools) > 0


def test_trimming_gives_back_the_oldest_idle_buffers_first():
    pool = WeightBuffers()
    large, old, middle, new = torch.empty(64), torch.empty(4), torch.empty(8), torch.empty(4)
    view = large[1:]  # a larger task seen, its buffer kept by a view: the size limit leaves the three below
    pool.give([large], "e0")
    pool.give([old], "e1")
    pool.give([middle], "e2")
    pool.give([new], "e3")
    pool.trim_to(12 * 4)  # room for 12 floats: the oldest (4) goes, the other two stay
    assert pool.idle_bytes == 12 * 4
    assert pool.take(4, torch.float32)[0] is new and pool.take(8, torch.float32)[0] is middle
    pool.give([torch.empty(4)], "e4")
    pool.trim_to(0)
    assert pool.idle_bytes == 0 and pool.take(4, torch.float32) is None
    del view


class _Tracked:
    tracks_memory = True

    def __init__(self, allocated):
        self.allocated = allocated

    def allocated_bytes(self):
        return self.allocated


class _Plan:
    def __init__(self, limit):
        self.lookahead_limit_bytes = limit


class _Job:
    def __init__(self, limit):
        self.plan = _Plan(limit)


def test_idle_buffers_stay_only_within_the_plan_s_limit_for_a_running_task():
    """The idle bytes allowed keep the allocated memory, idle buffers included, under the plan's limit; none
    without a limit (unplanned, CPU workers, the end of a pass)."""
    from accelerate_roundpipe.runtime.execution.residency import ParamResidency

    residency = ParamResidency.__new__(ParamResidency)  # only its device, buffers and the rule are read
    residency.buffers = WeightBuffers()
    residency.buffers.give([torch.empty(256)], "e")  # 1 KiB idle
    residency.device = _Tracked(allocated=10_000)  # the idle KiB included
    assert residency._idle_room(_Job(limit=9_500)) == 9_500 - (10_000 - 1024)
    assert residency._idle_room(_Job(limit=5_000)) == 0  # over the limit without them: none stays
    assert residency._idle_room(_Job(limit=0)) == 0  # no plan yet
    assert residency._idle_room(None) == 0  # the end of a pass
    residency.device.tracks_memory = False
    assert residency._idle_room(_Job(limit=9_500)) == 0  # CPU workers


def test_buffers_of_one_size_and_age_in_two_dtypes_are_trimmed():
    """A task can give back flats of the same size in two dtypes (a layer whose parameters are bucketed by dtype);
    aging them out and trimming order by age alone (dtypes have no order: this raised TypeError in the worker)."""
    pool = WeightBuffers()
    pool.give([torch.empty(8, dtype=torch.bfloat16), torch.empty(8, dtype=torch.float32)], "e0")
    for i in range(weight_buffers.IDLE_TASKS):
        pool.give([torch.empty(8, dtype=torch.bfloat16), torch.empty(8, dtype=torch.float32)], f"e{i + 1}")
    assert pool.take(8, torch.float32) is not None and pool.take(8, torch.bfloat16) is not None
    pool.trim_to(0)
    assert pool.idle_bytes == 0


def test_idle_buffers_go_back_when_the_running_task_waits_for_its_versions_and_nothing_is_queued():
    """The running task still has uploads to issue (a version being written), so a prefetch would wait for them
    ([Note: the running task's uploads first]); with no next job queued none will follow, and the idle buffers go
    back at once instead of staying while the task computes (a flake of the test above found them kept)."""
    from types import SimpleNamespace

    from accelerate_roundpipe.runtime.execution.residency import ParamResidency

    residency = ParamResidency.__new__(ParamResidency)
    residency.buffers = WeightBuffers()
    residency.buffers.give([torch.empty(256)], "e")  # 1 KiB idle
    residency.device = _Tracked(allocated=10_000)
    running = SimpleNamespace(unissued=[(0, None)])
    residency.prefetch(None, running)
    assert residency.buffers.idle_bytes == 0 and residency._deferred is None
    residency.buffers.give([torch.empty(256)], "e2")
    queued = _Job(limit=0)
    residency.prefetch(queued, running)  # a next job: deferred, its prefetch trims when it runs
    assert residency._deferred is queued and residency.buffers.idle_bytes == 1024
