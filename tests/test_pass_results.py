"""[Note: a pass's plan and results]: what a pass's tasks leave behind is checked empty when the pass ends, and every
kind of pass ends empty."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from accelerate_roundpipe import RoundPipe, RoundPipeConfig
from accelerate_roundpipe.runtime.execution.worker import Worker

from toy_models import batch, tied_model


def _engine(num_devices: int, recompute: str = "stage") -> RoundPipe:
    return RoundPipe(tied_model(dropout=0.3), RoundPipeConfig(devices=["cpu"] * num_devices, num_microbatches=2,
                                                              recompute=recompute))


def test_a_saved_input_no_backward_reads_is_reported_when_the_pass_ends(monkeypatch):
    """A saved layer input left behind (injected: one under a layer no backward reads) fails the end of the pass
    with a message naming it, instead of holding host memory silently."""
    original = Worker._save_input

    def save_one_more(self, job, layer, mb, h):
        original(self, job, layer, mb, h)
        if layer == 1 and mb == 0:
            original(self, job, 1000, mb, h)

    monkeypatch.setattr(Worker, "_save_input", save_one_more)
    engine = _engine(num_devices=2)
    x, mask, y = batch(rows=4)
    try:
        engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy)
        with pytest.raises(RuntimeError, match=r"pass 0 ended with results left in it: 1 saved layer input\(s\) "
                                               r"never read back by a backward: \(layer 1000, micro-batch 0\)"):
            engine.synchronize()
    finally:
        engine.close()


@pytest.mark.parametrize("recompute", ["stage", "layer"])
@pytest.mark.parametrize("num_devices", [1, 3])
def test_every_kind_of_pass_ends_with_its_results_taken(monkeypatch, num_devices, recompute):
    """Fused training, forward then backward, evaluation under no_grad and a forward with grad whose backward never
    comes (its saved inputs go with its autograd graph): each pass's results are checked and found empty."""
    from accelerate_roundpipe.runtime.execution.jobs import PassResults

    checked = []
    original = PassResults.check_drained

    def counting(self):
        original(self)
        checked.append(self.index)

    monkeypatch.setattr(PassResults, "check_drained", counting)
    engine = _engine(num_devices, recompute)
    x, mask, y = batch(rows=6)
    try:
        engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy)  # pass 0
        engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy,
                                deferred=True).backward()  # pass 1
        nn.functional.cross_entropy(engine(x, mask), y).backward()  # pass 2 and its backward
        with torch.no_grad():
            engine(x, mask)  # pass 3
        engine(x, mask)  # pass 4: kept for a backward that never comes
        engine.synchronize()
        assert sorted(set(checked)) == [0, 1, 2, 3, 4]
    finally:
        engine.close()


def test_a_caller_interrupted_while_taking_the_losses_is_not_reported_as_a_leftover(monkeypatch):
    """Ctrl-C while `forward_backward` waits for the losses: the pass's losses stay untaken, and the end-of-pass
    check must not call that a RoundPipe bug at the next pass."""
    from accelerate_roundpipe.runtime.common.sync import FailureFlag, Future
    from accelerate_roundpipe.runtime.execution.jobs import PassResults

    def interrupted(self, failure):
        raise KeyboardInterrupt

    results = PassResults(0, num_losses=2)
    monkeypatch.setattr(Future, "take", interrupted)
    with pytest.raises(KeyboardInterrupt):
        results.take_losses(FailureFlag())
    results.check_drained()  # the caller came for them: nothing to report
    with pytest.raises(RuntimeError, match="2 micro-batch loss"):
        PassResults(1, num_losses=2).check_drained()  # never asked for: still reported
