"""What a sharded optimizer step asks of its group of processes (`ShardCollectives`), and the error a failed
collective, a failed peer or differing settings raise (`DataParallelError`).

Below both the group (`gloo_exchange.DataParallelGroup`, which implements these methods and hands out the sharded
layout) and the layouts (`shards.ShardedSteps`, `whole_buckets.WholeBuckets`), so that neither imports the other's
module: a group over another backend (NCCL) implements the same methods and shards stay as they are
([Note: gradient exchange])."""

from __future__ import annotations

from typing import Protocol

import torch


class DataParallelError(RuntimeError):
    """A collective across the data-parallel ranks failed, a peer rank failed, or the ranks' settings differ."""


class ShardCollectives(Protocol):
    """The collectives `ShardedSteps` runs around each bucket's step on the optimizer thread ([Note: data parallel])."""

    rank: int
    world_size: int

    def shard_range(self, numel: int) -> tuple[int, int]:
        """This rank's range of a padded flat buffer of `numel` elements."""

    def reduce_scatter(self, out: torch.Tensor, flat: torch.Tensor, what: str) -> None:
        """`out` = this rank's range of the sum over ranks of `flat`."""

    def all_gather(self, flat: torch.Tensor, what: str) -> None:
        """Fill `flat` with every rank's range."""

    def sum_on_optimizer_thread(self, value: float, what: str) -> float:
        """`value` summed over the ranks, in order with the optimizer thread's other collectives."""

    def sum_tensor_on_optimizer_thread(self, tensor: torch.Tensor, what: str) -> None:
        """`tensor` summed over the ranks in place, in order with the optimizer thread's other collectives."""
