"""The engine and its optimizer reach other processes only through the gradient exchange they are built with
([Note: gradient exchange] in `runtime/gradient_exchange.py`): one process has `NoExchange`, and an exchange put in
its place sees every check, weight broadcast, binding, sum, loss, layout and meeting the engine does."""

from __future__ import annotations

import torch
from torch import nn

from accelerate_roundpipe import RoundPipe, RoundPipeConfig
from accelerate_roundpipe.runtime import engine_parts
from accelerate_roundpipe.runtime.gradient_exchange import NoExchange
from accelerate_roundpipe.runtime.whole_buckets import WholeBuckets


class RecordingExchange(NoExchange):
    """One process, recording what the engine asks of its exchange."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def check_same(self, what, settings) -> None:
        self.calls.append(f"check_same {what}")

    def broadcast_weights(self, store) -> None:
        self.calls.append("broadcast_weights")  # every rank starts from rank 0's weights

    def bind(self, failure, finish_with_peers) -> None:
        self.calls.append("bind")

    def optimizer_layout(self, user, store, trace=None):
        self.calls.append("optimizer_layout")
        return super().optimizer_layout(user, store, trace)

    def sum_over_ranks(self, values, what):
        self.calls.append("sum_over_ranks")
        return values

    def global_loss(self, loss, what):
        self.calls.append("global_loss")
        return loss

    def meet_peers(self, only_after_collectives: bool = False) -> None:
        self.calls.append(f"meet_peers {only_after_collectives}")

    def close(self, clean: bool = True) -> None:
        self.calls.append(f"close {clean}")


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
