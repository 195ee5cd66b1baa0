"""[Note: bucket flats filled once]: a bucket's compute and optimizer copies are allocated uninitialized, the
parameters copied in and only the gaps between them (alignment, padding) zeroed, so the flats hold what
zeros-then-copy gave. New buffers are filled with NaN here, which a missed gap would keep."""

from __future__ import annotations

import torch
from torch import nn

from accelerate_roundpipe import RoundPipe, RoundPipeConfig
from accelerate_roundpipe.runtime.state import host_store

from toy_models import assert_close, batch, reference_loss_and_grads, tied_model


def test_only_the_gaps_are_zeroed_and_the_parameters_are_copied_whole(monkeypatch):
    monkeypatch.setattr(host_store, "uninitialized",
                        lambda numel, dtype: torch.full((numel,), float("nan"), dtype=dtype))
    model = tied_model()  # 6 x 6 weights and 6-element biases: every slot leaves an alignment gap
    originals = {name: p.detach().clone() for name, p in model.named_parameters()}
    x, mask, y = batch(rows=7)
    ref_loss, ref_grads = reference_loss_and_grads(model, x, mask, y)
    engine = RoundPipe(model, RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=3, seed=0, plan="static",
                                              forward_stages=[2, 3], backward_stages=[2, 3, 4]))
    try:
        gaps = 0
        for bucket in engine.host_store.buckets:
            flats = [bucket.compute] + ([bucket.optim] if bucket.optim is not None else [])
            for flat in flats:
                assert not torch.isnan(flat).any(), f"bucket {bucket.index}: a gap kept the new buffer's NaN"
            covered = torch.zeros(bucket.compute.numel(), dtype=torch.bool)
            for slot in bucket.slots:
                covered[slot.offset:slot.offset + slot.numel] = True
            gaps += int((~covered).sum())
            for flat in flats:
                assert torch.equal(flat[~covered], torch.zeros_like(flat[~covered]))
        assert gaps > 0  # the model does have gaps to zero
        for name, p in engine.named_parameters():
            assert torch.equal(p.detach(), originals[name]), name
        loss = engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy)
        engine.synchronize()
        assert_close(loss, ref_loss, 1e-12, "loss")
        for name, p in engine.named_parameters():
            assert_close(p.grad, ref_grads[name], 1e-12, f"grad of {name}")
    finally:
        engine.close()
