"""[Note: no spare gradient buffer]: a host bucket holds a gradient buffer only while it holds gradients (none at
build, given back to the pool by `zero_grad(set_to_none=True)`), the pool lets go of a burst once its size is
idle, and none of it changes a number."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from accelerate_roundpipe import RoundPipe, RoundPipeConfig
from accelerate_roundpipe.runtime.devices.pinned import HostMemory
from accelerate_roundpipe.runtime.state.grad_buffers import KEEP_PERIODS, GradBufferPool

from toy_models import batch, tied_model, train_tied_model


def gradient_bytes(engine) -> tuple[int, int, int]:
    """Host gradient bytes: held by the buckets, free in the pool, and one buffer per trainable bucket."""
    store = engine._store
    held = sum(b.grad.numel() * b.grad.element_size() for b in store.trainable_buckets if b.grad is not None)
    whole = sum(b.optim.numel() * b.optim.element_size() for b in store.trainable_buckets)
    return held, store.grad_pool.free_bytes(), whole


def test_the_store_makes_no_gradient_buffer_at_build():
    engine = RoundPipe(tied_model(), RoundPipeConfig(devices=["cpu"]))
    held, free, whole = gradient_bytes(engine)
    assert whole > 0
    assert (held, free) == (0, 0)
    assert all(b.grad is None and not b.grad_valid for b in engine._store.trainable_buckets)
    engine.close()


def test_zero_grad_set_to_none_gives_every_host_buffer_back():
    engine = RoundPipe(tied_model(), RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=2))
    optimizer = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-3))
    x, mask, y = batch(rows=8)
    for _ in range(3):
        engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy)
        optimizer.step()
        optimizer.zero_grad()
    engine.synchronize()
    held, free, whole = gradient_bytes(engine)
    assert held == 0  # the buckets hold no buffer
    assert all(b.grad is None for b in engine._store.trainable_buckets)
    assert engine._store.grad_pool.out_count() == 0
    # What the steps needed at once, no spare beside it: the gradients downloaded and not yet stepped and the
    # downloads in flight beside them (a tied weight's second download; at most one a worker and size).
    buckets = engine._store.trainable_buckets
    for (numel, dtype), free_list in engine._store.grad_pool._free.items():
        of_size = sum(b.optim.numel() == numel and b.optim.dtype == dtype for b in buckets)
        assert 1 <= len(free_list) <= of_size + 2, (numel, len(free_list), of_size)
    assert 0 < free <= 2 * whole
    engine.close()


def test_a_burst_is_released_once_its_size_is_idle():
    pool = GradBufferPool(HostMemory(pinned=False))
    like = torch.zeros(1000, dtype=torch.float32)
    burst = [pool.take(like) for _ in range(5)]  # e.g. every gradient of a clipped step alive at once
    for buffer in burst:
        pool.give(buffer)
    assert pool.free_bytes() == 5 * 4000  # the busy period needed 5 at once: the next one reuses them
    for _ in range(KEEP_PERIODS - 1):  # then one at a time (a bucket's download, its step, its zeroing)
        pool.give(pool.take(like))
    assert pool.free_bytes() == 5 * 4000  # within the last KEEP_PERIODS busy periods: kept
    pool.give(pool.take(like))
    assert pool.free_bytes() == 4000
    assert pool.allocated == 5 and pool.released == 4
    assert (pool.bytes, pool.peak_bytes) == (4000, 20000)  # alive now, and at most


def test_a_jittering_steady_state_allocates_nothing_anew():
    """Busy periods needing 3, 2, 3, 2, ... buffers at once (the host step's backlog differs by one between steps):
    nothing is released and page-locked again every other step. Before, each period of 2 released one buffer and
    the next period of 3 allocated it again (allocated 3 + 9 after 20 periods)."""
    pool = GradBufferPool(HostMemory(pinned=False))
    like = torch.zeros(100, dtype=torch.float32)
    for period in range(20):
        taken = [pool.take(like) for _ in range(3 if period % 2 == 0 else 2)]
        for buffer in taken:
            pool.give(buffer)
    assert (pool.allocated, pool.released) == (3, 0)


def test_a_size_held_busy_keeps_only_the_downloads_in_flight():
    pool = GradBufferPool(HostMemory(pinned=False))
    like = torch.zeros(10, dtype=torch.float64)
    held = pool.take(like)  # a bucket's gradients, kept across steps (zero_grad(set_to_none=False))
    for _ in range(4):  # downloads added into it, each given back after its commit
        pool.give(pool.take(like))
    assert pool.free_bytes() == 80 and pool.allocated == 2
    pool.give(held)
    assert pool.out_count() == 0


@pytest.mark.parametrize("clip, calls", [(None, 1), (0.05, 1), (None, 2), (0.05, 2)])
def test_buffers_given_back_change_no_number(clip, calls):
    """A tied weight (two commits a pass: a swap, then an add), clipping and accumulation: zero_grad giving the
    buffers back and zero_grad zeroing them in place train bitwise the same."""
    losses, weights = train_tied_model(True, clip, calls)
    kept_losses, kept_weights = train_tied_model(False, clip, calls)
    assert torch.equal(losses, kept_losses)
    for name, value in weights.items():
        assert torch.equal(value, kept_weights[name]), name


def test_a_deferred_pass_into_buffers_given_back_is_exact():
    """A stock loop (`loss.backward()` on a deferred pass) accumulating over buckets that gave their buffers
    back: the first call swaps, the second is held apart and added at its backward, as with buffers kept."""
    results = []
    for set_to_none in (True, False):
        engine = RoundPipe(copy.deepcopy(tied_model()), RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=2))
        optimizer = engine.wrap_optimizer(torch.optim.SGD(engine.parameters(), lr=0.1))
        for step in range(3):
            for call in range(2):
                x, mask, y = batch(rows=8, seed=10 * step + call)
                engine.expect_grad_scale(0.5)
                loss = engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy, deferred=True)
                (loss * 0.5).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=set_to_none)
        engine.synchronize()
        results.append({name: p.detach().clone() for name, p in engine.named_parameters()})
        engine.close()
    for name, value in results[0].items():
        assert torch.equal(value, results[1][name]), name
