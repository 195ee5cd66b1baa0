"""A one-process gradient exchange that records what is asked of it, for the tests that put it in place of the
engine's `NoExchange` ([Note: gradient exchange] in `runtime/distribution/gradient_exchange.py`)."""

from __future__ import annotations

from accelerate_roundpipe.runtime.distribution.gradient_exchange import NoExchange


class RecordingExchange(NoExchange):
    """One process (every call does what `NoExchange` does), recording what the engine and the model ask of it:
    `calls`, every call in order; `sums`, what each `sum_over_ranks` summed (its `what`)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.sums: list[str] = []

    def check_same(self, what, settings) -> None:
        self.calls.append(f"check_same {what}")
        super().check_same(what, settings)

    def broadcast_weights(self, store) -> None:
        self.calls.append("broadcast_weights")  # every rank starts from rank 0's weights
        super().broadcast_weights(store)

    def bind(self, failure, finish_with_peers) -> None:
        self.calls.append("bind")
        super().bind(failure, finish_with_peers)

    def optimizer_layout(self, user, store, trace=None):
        self.calls.append("optimizer_layout")
        return super().optimizer_layout(user, store, trace)

    def sum_over_ranks(self, values, what):
        self.calls.append("sum_over_ranks")
        self.sums.append(what)
        return super().sum_over_ranks(values, what)

    def global_loss(self, loss, what):
        self.calls.append("global_loss")
        return super().global_loss(loss, what)

    def meet_peers(self, only_after_collectives: bool = False) -> None:
        self.calls.append(f"meet_peers {only_after_collectives}")
        super().meet_peers(only_after_collectives)

    def close(self, clean: bool = True) -> None:
        self.calls.append(f"close {clean}")
        super().close(clean)
