"""The engine and its optimizer reach other processes only through the gradient exchange they are built with
([Note: gradient exchange] in `runtime/distribution/gradient_exchange.py`): one process has `NoExchange`, and an
exchange put in its place sees every check, weight broadcast, binding, sum, loss, layout and meeting the engine does."""

from __future__ import annotations

import torch
from exchange_helpers import RecordingExchange
from torch import nn

from accelerate_roundpipe import RoundPipe, RoundPipeConfig
from accelerate_roundpipe.runtime.distribution.whole_buckets import WholeBuckets
from accelerate_roundpipe.runtime.engine import engine_parts


def _engine() -> RoundPipe:
    torch.manual_seed(0)
    return RoundPipe(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)),
                     RoundPipeConfig(devices=["cpu"], num_microbatches=1))


def test_one_process_has_no_exchange_and_sums_to_its_own_values():
    engine = _engine()
    try:
        assert engine.data_parallel is None
        assert engine.sum_over_ranks([1.0, 2.0, 3.0], "a test's sum") == [1.0, 2.0, 3.0]
        optimizer = engine.wrap_optimizer(torch.optim.SGD(engine.parameters(), lr=0.1))
        assert isinstance(optimizer.layout, WholeBuckets)
    finally:
        engine.close()


def test_the_engine_reaches_other_processes_through_its_exchange_only(monkeypatch):
    exchange = RecordingExchange()
    monkeypatch.setattr(engine_parts, "gradient_exchange", lambda setting, timeout_s: exchange)
    engine = _engine()
    optimizer = engine.wrap_optimizer(torch.optim.SGD(engine.parameters(), lr=0.1))
    engine.forward_backward(torch.randn(4, 4), labels=torch.randn(4, 3), loss_fn=nn.functional.mse_loss)
    optimizer.step()
    engine.synchronize_ranks()
    engine.close()
    assert exchange.calls == ["check_same the engine settings", "broadcast_weights", "bind",
                              "check_same the optimizer", "optimizer_layout",
                              "sum_over_ranks", "global_loss", "meet_peers False", "meet_peers True", "close True"]
