"""How one process steps: every trainable bucket whole, its gradients as the backward left them (no exchange).

The optimizer thread asks its layout (this, or `ShardedSteps` under data parallelism: [Note: data parallel]) for
everything that differs between the two: the state owner and the per-bucket steppers
([Note: one owner of the step's groups]), the gradients a step reads (`prepare_step`), their squared norm, their
scaling by a clip, what follows a step (`finish_step`), the order of an exact step, and the state dict.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from ..state.host_store import Bucket, HostStore
from ..stepping.steppers import BucketSteppers, hyper_parameters, prefer_fused, shallow_copy
from .collectives import DataParallelError


class WholeBuckets:
    """One process's layout of the optimizer step: the user's parameters, whole."""

    fixed_order = False  # an exact step may take the buckets as their gradients land ([Note: exact step order])
    total_norm = None  # the clip's norm is this process's own

    def __init__(self, user: torch.optim.Optimizer, store: HostStore) -> None:
        self.user = user
        self.owner = shallow_copy(user, [dict(g, params=list(g["params"])) for g in user.param_groups])
        self.owner.state = defaultdict(dict)
        # The steppers step each slot's twin, which only the bucket gives a `.grad`; the state stays keyed by the
        # optimizer copies the user holds ([Note: parameters without a gradient]).
        self.steppers = BucketSteppers(self.owner, {
            bucket.index: [[s.twin for s in bucket.slots if id(s.optim) in ids] for ids in
                           ({id(p) for p in g["params"]} for g in user.param_groups)]
            for bucket in store.trainable_buckets},
            canonical={id(s.twin): s.optim for bucket in store.trainable_buckets for s in bucket.slots})
        if user.state:  # e.g. loaded before `prepare`: the steps go on from it, in the owner's own tensors
            state = user.state_dict()
            state["state"] = {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in values.items()}
                              for i, values in state["state"].items()}
            self.load_state_dict(state)

    @property
    def state(self) -> dict:
        return self.owner.state

    def has_gradient(self, bucket: Bucket, ticket: int) -> bool:
        """Whether the loss reached `bucket` since its gradients were last set to None (in its turn `ticket`)."""
        return bucket.grad_valid

    def holds_gradient(self, bucket: Bucket) -> bool:
        return bucket.grad_valid

    def prepare_step(self, bucket: Bucket, ticket: int) -> None:
        """Nothing to exchange: the bucket's gradients are the step's."""

    def squared_norm(self, bucket: Bucket, ticket: int) -> float:
        return bucket.squared_norm()

    def scale(self, bucket: Bucket, coefficient: float) -> None:
        bucket.scale(coefficient)

    def scaled_in_kernel(self, bucket: Bucket, coefficient: float) -> None:
        bucket.record_scale(coefficient)  # the kernel left the scaled gradients in `.grad`

    def finish_step(self, bucket: Bucket) -> None:
        """Nothing to exchange: the stepped optimizer copy is the whole bucket's."""

    def release(self) -> None:
        """The engine closed: let go of the optimizer state and of the steppers' views of the optimizer copies
        ([Note: memory freed at close]); nothing steps afterwards."""
        self.owner.state.clear()
        self.steppers = None

    def state_dict(self) -> dict[str, Any]:
        """The user's optimizer's state dict format, with the hyper-parameters of the user's groups now."""
        for mine, theirs in zip(self.owner.param_groups, hyper_parameters(self.user.param_groups)):
            mine.update(theirs)
        return self.owner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        meta = state_dict.get("data_parallel")
        if meta is not None:
            raise DataParallelError(
                f"this optimizer state is rank {meta['rank']}'s shard of a run with {meta['world_size']} "
                f"data-parallel processes; this engine runs on one process. Resume with {meta['world_size']} "
                f"processes, each loading its own rank's file.")
        self.owner.load_state_dict(state_dict)
        for theirs, mine in zip(self.user.param_groups, hyper_parameters(self.owner.param_groups)):
            theirs.update(mine)  # the loaded settings, where schedulers and the next step() read them
        prefer_fused(self.user)
        self.steppers.share_state(self.owner.state)
