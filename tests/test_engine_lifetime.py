"""Engine lifetime: an engine dropped without `close()` cancels its pending work and stops its threads at once, and
a failed engine is freed (threads and host store), closed or not."""

from __future__ import annotations

import gc
import os
import threading
import time
import weakref

import pytest
import torch
from torch import nn

from accelerate_roundpipe import RoundPipe, RoundPipeConfig
from accelerate_roundpipe.runtime.common import faults

from toy_models import batch, tied_model


def _engine_thread_count() -> int:
    return sum(t.name.startswith("roundpipe") for t in threading.enumerate())


def _train_one_step():
    engine = RoundPipe(tied_model(), RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=2))
    optimizer = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-3))
    x, mask, y = batch(rows=4)
    engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy)
    optimizer.step()  # pending: the step waits for gradients still being committed
    return weakref.ref(engine), engine, optimizer


def test_engines_dropped_with_work_pending_stop_at_once():
    """Before: the finalizer stopped the commit threads ahead of the commits still to come, and then joined an
    optimizer thread waiting for them (about 10 s per engine; a loop of engines never ended)."""
    start = time.monotonic()
    refs = []
    for _ in range(30):
        ref, engine, optimizer = _train_one_step()
        del engine, optimizer
        refs.append(ref)
    gc.collect()
    assert time.monotonic() - start < 60  # 30 engines; a single hung teardown took 10 s
    assert all(r() is None for r in refs)
    assert _engine_thread_count() == 0


@pytest.mark.parametrize("closed", [True, False])
def test_a_failed_engine_is_freed(closed):
    """Before: the failure flag kept the error, whose traceback (raised in the caller) held the engine's frames, and
    the finalizer registry held the flag: every failed engine and its host store stayed alive, threads too."""
    def fail(point: str) -> None:
        if point == "optimizer.step":
            raise RuntimeError("injected optimizer failure")

    refs = []
    for _ in range(3):
        with faults.injected(fail):
            ref, engine, optimizer = _train_one_step()
            with pytest.raises(RuntimeError, match="injected optimizer failure"):
                engine.synchronize()
        if closed:
            engine.close()
        del engine, optimizer
        refs.append(ref)
    gc.collect()
    assert all(r() is None for r in refs)
    assert _engine_thread_count() == 0


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the resident set size from /proc")
def test_two_hundred_engines_created_trained_and_dropped():
    """Create, train one step and drop (no close(), the step still pending) 200 engines: bounded time, threads and
    memory flat. Each engine's host store is about 1 MiB, so a leak of even one engine in ten would show."""
    width = 128
    threads, rss, refs = [], [], []
    start = time.monotonic()
    for index in range(200):
        torch.manual_seed(index)
        engine = RoundPipe(nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width)),
                           RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=2))
        optimizer = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-3))
        engine.forward_backward(torch.randn(4, width), labels=torch.randn(4, width), loss_fn=nn.functional.mse_loss)
        optimizer.step()
        refs.append(weakref.ref(engine))
        del engine, optimizer
        if index % 50 == 49:
            gc.collect()
            threads.append(_engine_thread_count())
            rss.append(_rss_mib())
    elapsed = time.monotonic() - start
    print(f"200 engines: {elapsed:.1f} s, engine threads {threads}, resident MiB {[round(r) for r in rss]}")
    assert elapsed < 120, f"200 engines took {elapsed:.0f} s"
    assert threads == [0, 0, 0, 0]
    assert all(r() is None for r in refs)
    assert rss[-1] - rss[0] < 40, f"resident memory grew from {rss[0]:.0f} to {rss[-1]:.0f} MiB"
