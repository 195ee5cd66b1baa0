"""One stepper per trainable bucket: an optimizer of the user's class over that bucket's parameters, with groups of
its own.

[Note: one owner of the step's groups]
The optimizer thread steps bucket by bucket, each step with the hyper-parameters `step()` read on the caller's
thread. It used to do so by swapping the user's optimizer's `param_groups` for the bucket's groups around the class's
`step`: an LR scheduler on that optimizer writes those groups from the caller's thread meanwhile, and a write that
landed inside the swap went into the temporary groups and was lost (25 of 120 lagged steps ran with a stale
learning rate, `tests/test_scheduler_writes_kept.py`). Now nothing on the optimizer thread touches the user's
optimizer:
- the caller's thread owns the user's groups: `step()` snapshots their hyper-parameters (tensors cloned: a scheduler
  fills a tensor learning rate in place) and hands the snapshot to the step's jobs;
- each bucket has its stepper (`BucketSteppers`): a shallow copy of the state owner (the user's class and
  attributes, never its constructor, whose arguments we may not know) whose `param_groups` are its own objects over
  the bucket's parameters. Only the optimizer thread writes them: before each step it copies the step's snapshot
  in. All steppers share the owner's `state` (each writes the entries of its own parameters only), which is what
  `optimizer.state` and `state_dict()` show;
- the state owner is the layout's (`WholeBuckets` on one process, `ShardedSteps` under data parallelism): an
  optimizer of the user's class over every stepped parameter, with groups of its own that `state_dict()` fills
  from the user's groups on the caller's thread, after the optimizer thread is idle.
The user's instance hooks (`register_step_pre_hook`, ...) run around each bucket's step, as before, with the stepper
as their `optimizer` argument (its groups are the bucket's, with the step's hyper-parameters).
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import Any

import torch

from ..state.host_store import Bucket

FUSED_CPU = (torch.optim.Adam, torch.optim.AdamW)
# Optimizers whose update of a tensor reads that tensor's gradient and state only: stepping a bucket's shard, or
# several buckets in one call, gives what stepping each whole bucket alone gives.
ELEMENTWISE_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
                          torch.optim.RMSprop, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
                          torch.optim.Adadelta, torch.optim.Rprop, torch.optim.ASGD)


def prefer_fused(optimizer: torch.optim.Optimizer) -> None:
    """Use torch's fused CPU kernel for Adam/AdamW groups that did not choose an implementation."""
    if not isinstance(optimizer, FUSED_CPU):
        return
    for group in optimizer.param_groups:
        if group.get("fused") is None and not group.get("foreach") and not group.get("differentiable") \
                and all(p.is_floating_point() for p in group["params"]):
            group["fused"] = True
            group["foreach"] = False


def hyper_parameters(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What `step()` hands to its jobs: each group's settings, read now on the caller's thread (a tensor cloned: a
    scheduler fills a tensor learning rate in place)."""
    return [{k: v.clone() if torch.is_tensor(v) else v for k, v in g.items() if k != "params"} for g in groups]


def shallow_copy(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """An optimizer of `optimizer`'s class and attributes (without calling its constructor) over `groups`, which
    become its own `param_groups`."""
    copy = object.__new__(type(optimizer))
    copy.__dict__.update(optimizer.__dict__)  # its hooks too: the same objects, so hooks registered later run
    copy.param_groups = groups
    return copy


class StateThroughTwins(MutableMapping):
    """The state owner's `state` as a stepper over twins sees it: each twin's entry is the entry of the tensor it
    stands for (`canonical`: id of twin -> that tensor), so `optimizer.state` and `state_dict()` stay keyed by the
    optimizer copies the user holds ([Note: parameters without a gradient])."""

    def __init__(self, state: dict, canonical: dict[int, torch.Tensor]) -> None:
        self._state, self._canonical = state, canonical

    def _key(self, key: Any) -> Any:
        return self._canonical.get(id(key), key)

    def __getitem__(self, key: Any) -> Any:
        return self._state[self._key(key)]  # the owner's defaultdict makes a missing entry, as torch expects

    def __setitem__(self, key: Any, value: Any) -> None:
        self._state[self._key(key)] = value

    def __delitem__(self, key: Any) -> None:
        del self._state[self._key(key)]

    def __contains__(self, key: object) -> bool:
        return self._key(key) in self._state

    def __iter__(self) -> Iterator[Any]:
        return iter(self._state)

    def __len__(self) -> int:
        return len(self._state)


class BucketSteppers:
    """The per-bucket steppers of one optimizer; see [Note: one owner of the step's groups]."""

    def __init__(self, owner: torch.optim.Optimizer, pieces: dict[int, list[list[torch.Tensor]]],
                 canonical: dict[int, torch.Tensor] | None = None) -> None:
        # pieces: bucket index -> per group of the user's optimizer, the tensors of that bucket the stepper steps;
        # canonical: where those are twins, id of twin -> the tensor the state is keyed by
        self._canonical = canonical
        self._steppers: dict[int, tuple[torch.optim.Optimizer, list[int]]] = {}
        # Several buckets may be stepped in one call ([Note: device steps in one call]) only when that is exact.
        self.steps_together = type(owner) in ELEMENTWISE_OPTIMIZERS
        for index, per_group in pieces.items():
            members = [i for i, params in enumerate(per_group) if params]
            groups = [dict(owner.param_groups[i], params=list(per_group[i])) for i in members]
            self._steppers[index] = (shallow_copy(owner, groups), members)
        self.share_state(owner.state)

    def share_state(self, state: dict) -> None:
        """Every stepper writes into `state` (the owner's, replaced when a state dict is loaded)."""
        seen = state if self._canonical is None else StateThroughTwins(state, self._canonical)
        for stepper, _ in self._steppers.values():
            stepper.state = seen

    def groups(self, bucket: Bucket, hyper: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """`bucket`'s step settings: the snapshot `hyper` of each group that has parameters in it."""
        return [hyper[i] for i in self._steppers[bucket.index][1]]

    def step(self, bucket: Bucket, hyper: list[dict[str, Any]], grad_scale: float | None = None) -> None:
        """Step `bucket`'s parameters with the snapshot `hyper`; with `grad_scale`, the fused kernel divides the
        gradients by it as it reads them ([Note: clip in the kernel]). On the optimizer thread."""
        stepper, members = self._steppers[bucket.index]
        for group, i in zip(stepper.param_groups, members):
            group.update(hyper[i])
        _step_with_scale(stepper, grad_scale)

    def step_together(self, buckets: list[Bucket], hyper: list[dict[str, Any]],
                      grad_scale: float | None = None) -> None:
        """Step several buckets' parameters in one call of the optimizer's step: one multi-tensor kernel for all of
        them instead of one per bucket ([Note: device steps in one call]). Only for `steps_together` (an element-wise
        optimizer: the same as stepping each with its own stepper); hooks run once around the call. On the optimizer
        thread."""
        members = sorted({i for bucket in buckets for i in self._steppers[bucket.index][1]})
        params: dict[int, list[torch.Tensor]] = {i: [] for i in members}
        for bucket in buckets:
            stepper, bucket_members = self._steppers[bucket.index]
            for group, i in zip(stepper.param_groups, bucket_members):
                params[i].extend(group["params"])
        together = shallow_copy(self._steppers[buckets[0].index][0],
                                [dict(hyper[i], params=params[i]) for i in members])
        _step_with_scale(together, grad_scale)


def _step_with_scale(stepper: torch.optim.Optimizer, grad_scale: float | None) -> None:
    """The class's own step of `stepper` ([Note: scheduler step count]); with `grad_scale`, the fused kernel divides
    the gradients by it as it reads them ([Note: clip in the kernel]), for this call only."""
    if grad_scale is not None:
        stepper.grad_scale = torch.tensor(grad_scale, dtype=torch.float32)
    try:
        type(stepper).step(stepper)
    finally:
        if grad_scale is not None:
            del stepper.grad_scale
