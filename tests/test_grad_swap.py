"""Gradient commits ([Note: gradient swap]): a download into an empty bucket becomes its gradient buffer, a download
into a full one is added, and the recycled buffers neither leak nor get read after recycling."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from accelerate_roundpipe import RoundPipe, RoundPipeConfig
from accelerate_roundpipe.runtime.devices.pinned import HostMemory
from accelerate_roundpipe.runtime.state.grad_buffers import GradBufferPool

from toy_models import assert_close, batch, reference_loss_and_grads, tied_model

RTOL = 1e-10


@pytest.mark.parametrize("num_devices, num_mb", [(1, 1), (2, 2), (3, 4)])
def test_swapped_gradients_are_exact_and_buffers_are_recycled(num_devices, num_mb):
    model = tied_model()  # the tied weight's bucket gets two commits per pass: one swap, then one add
    x, mask, y = batch(rows=8)
    _, expected = reference_loss_and_grads(model, x, mask, y)
    engine = RoundPipe(copy.deepcopy(model), RoundPipeConfig(devices=["cpu"] * num_devices,
                                                             num_microbatches=num_mb))
    optimizer = engine.wrap_optimizer(torch.optim.SGD(engine.parameters(), lr=0.0))
    swapped, counts = 0, []
    for _ in range(8):
        # None after zero_grad: the buckets gave their buffers back ([Note: no spare gradient buffer])
        before = {b.index: None if b.grad is None else b.grad.data_ptr() for b in engine._store.trainable_buckets}
        engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy)
        engine.synchronize()
        swapped += sum(b.grad.data_ptr() != before[b.index] for b in engine._store.trainable_buckets)
        for name, p in engine.named_parameters():
            assert_close(p.grad, expected[name], RTOL, name)
        counts.append(engine._store.grad_pool.allocated)
        optimizer.step()
        optimizer.zero_grad()
    engine.close()
    assert swapped > 0, "no commit swapped its download in: the host did a copy per commit"
    # Spares depend on how many downloads of one size happen to be in flight together (timing: a loaded machine
    # once needed 3 more after the second pass), at most about one more per bucket; buffers not handed back would
    # make every pass allocate one per commit (6 passes x every bucket here).
    buckets = len(engine._store.trainable_buckets)
    assert counts[-1] - counts[1] <= buckets, f"gradient buffers allocated anew every pass: {counts}"


def test_commits_into_gradients_already_there_add():
    model = tied_model()
    x, mask, y = batch(rows=6)
    x2, mask2, y2 = batch(rows=6, seed=7)
    _, first = reference_loss_and_grads(model, x, mask, y)
    _, second = reference_loss_and_grads(model, x2, mask2, y2)
    engine = RoundPipe(copy.deepcopy(model), RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=2))
    engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy)
    engine.forward_backward(x2, mask2, labels=y2, loss_fn=nn.functional.cross_entropy)  # no zero_grad: accumulate
    engine.synchronize()
    for name, p in engine.named_parameters():
        assert_close(p.grad, first[name] + second[name], RTOL, name)
    engine.close()


def test_pool_hands_out_exact_sizes_and_reuses_returned_buffers():
    pool = GradBufferPool(HostMemory(pinned=False))
    like = torch.zeros(1000, dtype=torch.float32)
    a = pool.take(like)
    assert a.numel() == 1000 and a.dtype == torch.float32  # exact: no power-of-two rounding
    pool.give(a)
    assert pool.free_bytes() == 4000
    assert pool.take(like).data_ptr() == a.data_ptr()
    assert pool.take(torch.zeros(1000, dtype=torch.float64)).dtype == torch.float64  # keyed by dtype too
    assert pool.free_bytes() == 0
