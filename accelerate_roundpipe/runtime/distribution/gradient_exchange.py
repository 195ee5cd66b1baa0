"""The gradient exchange an engine is built with: how this process's gradients, losses and steps meet other
processes'.

[Note: gradient exchange]
The engine and the optimizer never ask whether they run data-parallel: they call their exchange, chosen once when
the engine is built (`gradient_exchange`).
- `NoExchange`: one process. Every call is nothing (or hands its values back), and the optimizer steps whole buckets
  (`WholeBuckets`).
- `DataParallelGroup` (`runtime/distribution/gloo_exchange.py`): data parallelism over gloo on the host
  ([Note: data parallel]). The optimizer steps this rank's shard (`ShardedSteps`), reduce-scattering and
  all-gathering each bucket.
An exchange over NCCL on the GPUs would be a third class with the same methods (its reduce-scatter fed from the
devices' gradient downloads): nothing in the engine or the optimizer would change. `engine.data_parallel` is the
exchange's `group` (None on one process), for what reads a rank and a world size (checkpoints, traces).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..common.sync import FailureFlag
from ..state.host_store import HostStore
from .gloo_exchange import EXCHANGE_WIDTH, DataParallelGroup
from .rank_settings import wants_data_parallel
from .whole_buckets import WholeBuckets


class NoExchange:
    """One process: nothing to exchange ([Note: gradient exchange])."""

    group = None
    rank = 0
    world_size = 1
    pad_multiple = 1  # the buckets need no padding into equal ranges

    def bind(self, failure: FailureFlag, finish_with_peers: Callable[[], None]) -> None:
        """Nothing waits on a peer."""

    def check_same(self, what: str, settings: dict[str, Any]) -> None:
        """No other rank to agree with."""

    def broadcast_weights(self, store: HostStore) -> None:
        """The weights are this process's."""

    def optimizer_layout(self, user: torch.optim.Optimizer, store: HostStore, trace=None) -> WholeBuckets:
        return WholeBuckets(user, store)

    def sum_over_ranks(self, values: list[float], what: str) -> list[float]:
        if len(values) > EXCHANGE_WIDTH:  # refused here too, so that one process finds the mistake
            raise ValueError(f"a per-pass exchange sums at most {EXCHANGE_WIDTH} values; got {len(values)}.")
        return values

    def global_loss(self, loss: torch.Tensor, what: str) -> torch.Tensor:
        return loss

    def pass_failed(self, error: BaseException, where: str, failure: FailureFlag) -> None:
        """Nobody waits for this pass but the caller, who gets the error."""

    def before_abandon(self) -> None:
        """No peer waits for this engine's steps: they are cancelled."""

    def meet_peers(self, only_after_collectives: bool = False) -> None:
        """No peer to wait for."""

    def close(self, clean: bool = True) -> None:
        """Nothing to stop."""


def gradient_exchange(setting: bool | None, timeout_s: float) -> NoExchange | DataParallelGroup:
    """The exchange of an engine built now (`data_parallel`, env ROUNDPIPE_DATA_PARALLEL)."""
    return DataParallelGroup(timeout_s) if wants_data_parallel(setting) else NoExchange()
