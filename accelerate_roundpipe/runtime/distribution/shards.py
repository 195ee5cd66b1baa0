"""How a data-parallel rank steps: its range of every trainable bucket, an optimizer of the user's class over views
of those ranges (the state owner of [Note: one owner of the step's groups]), the collectives around each bucket's
step, and that shard's state dict ([Note: data parallel]). One process steps whole buckets instead
(`whole_buckets.py`); the optimizer thread asks either the same things.

[Note: shards of another world size]
A shard's state dict carries its layout: per parameter of the shard optimizer, the bucket, the parameter's name and
the element range `[start, end)` of that parameter it holds. The shards of every rank of one run together cover
every element of every stepped parameter once, so they join into the state dict ONE process's optimizer would
have (`full_state_of_shards`: element-wise tensors concatenated in range order, step counts taken as they are, the
same on every rank), whatever the padding or the world size that cut them. That full state then loads anywhere: one
process loads it as it is, N processes each cut their own range from it (`ShardedSteps._shard_of_full`). So a
checkpoint written by M processes resumes on any number (`RoundPipeOptimizer.load_shards`); one rank's shard alone is
still refused by `load_state_dict` at another world size: it holds a part of the state only.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ...telemetry.trace import maybe_span
from ..state.host_store import Bucket, HostStore
from ..stepping.steppers import ELEMENTWISE_OPTIMIZERS, BucketSteppers, hyper_parameters, prefer_fused
from .collectives import DataParallelError, ShardCollectives


@dataclass(eq=False)
class BucketShard:
    """Rank's range `[lo, hi)` of one trainable bucket."""

    bucket: Bucket
    lo: int
    hi: int
    grad: torch.Tensor  # this rank's range of the reduced (global) gradient, the `.grad` of every piece
    pieces: list[list[nn.Parameter]]  # per param group of the user's optimizer: views of `bucket.optim`
    # per piece: the bucket slot it is a part of, and its view of `grad` (its `.grad` while some rank reached it)
    slot_pieces: list[tuple[int, nn.Parameter, torch.Tensor]] = field(default_factory=list)
    reduced_at: int | None = None  # the gradient turn in which `grad` was last reduced
    reached_at: int | None = None  # the gradient turn in which `reached` was agreed
    reached: tuple[bool, ...] = ()  # per slot: did some rank's loss reach it ([Note: parameters no rank reaches])

    def squared_norm(self) -> float:
        return float(torch.linalg.vector_norm(self.grad)) ** 2  # the padding's gradient is zero


@dataclass(eq=False)
class _Piece:
    param: nn.Parameter
    bucket_index: int
    slot_name: str
    start: int  # the piece's range inside its parameter (flattened)
    end: int


@dataclass(eq=False)
class ShardedSteps:
    """Builds and holds the shard optimizer and its per-bucket steppers; runs the collectives of each bucket's step
on the optimizer thread; see [Note: data parallel]."""

    user: torch.optim.Optimizer
    store: HostStore
    group: ShardCollectives
    trace: Any = None
    shards: dict[int, BucketShard] = field(default_factory=dict)  # bucket index -> its shard
    fixed_order = True  # an exact step takes the buckets in the same order on every rank ([Note: exact step order])

    def __post_init__(self) -> None:
        if type(self.user) not in ELEMENTWISE_OPTIMIZERS:
            names = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
            raise DataParallelError(
                f"{type(self.user).__module__}.{type(self.user).__qualname__} cannot be stepped in shards: RoundPipe's "
                f"data parallelism steps each rank's range of the weights separately, which is exact only for "
                f"element-wise optimizers ({names}). Use one of those, or train on one process.")
        group_of = {id(p): i for i, g in enumerate(self.user.param_groups) for p in g["params"]}
        self._pieces_of_param: dict[int, list[_Piece]] = {}
        by_group: list[list[_Piece]] = [[] for _ in self.user.param_groups]
        for bucket in self.store.trainable_buckets:
            lo, hi = self.group.shard_range(bucket.optim.numel())
            grad = torch.zeros(hi - lo, dtype=bucket.optim.dtype)
            pieces: list[list[nn.Parameter]] = [[] for _ in self.user.param_groups]
            slot_pieces = []
            for slot_index, slot in enumerate(bucket.slots):
                index = group_of.get(id(slot.optim))
                start, end = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
                if index is None or start >= end:
                    continue
                param = nn.Parameter(bucket.optim[start:end])
                param.grad = grad[start - lo:end - lo]
                slot_pieces.append((slot_index, param, param.grad))
                pieces[index].append(param)
                piece = _Piece(param, bucket.index, slot.name, start - slot.offset, end - slot.offset)
                by_group[index].append(piece)
                self._pieces_of_param.setdefault(id(slot.optim), []).append(piece)
            self.shards[bucket.index] = BucketShard(bucket, lo, hi, grad, pieces, slot_pieces)
        self._pieces = [piece for pieces in by_group for piece in pieces]  # the shard optimizer's parameter order
        groups = [dict(self._hyper(g), params=[p.param for p in pieces])
                  for g, pieces in zip(self.user.param_groups, by_group)]
        accepted = inspect.signature(type(self.user).__init__).parameters
        self.optimizer = type(self.user)(groups, **{k: v for k, v in self.user.defaults.items() if k in accepted})
        prefer_fused(self.optimizer)
        self.steppers = BucketSteppers(self.optimizer, {i: shard.pieces for i, shard in self.shards.items()})

    @property
    def owner(self) -> torch.optim.Optimizer:
        return self.optimizer

    @property
    def state(self) -> dict:
        return self.optimizer.state

    def total_norm(self, squares: float) -> float:
        """The clip's norm is the reduced (global) gradient's: the sum over ranks of their ranges' squares."""
        return self.group.sum_on_optimizer_thread(squares, "the all-reduce of the gradient norm")

    def has_gradient(self, bucket: Bucket, ticket: int) -> bool:
        """[Note: parameters no rank reaches]
        Whether some rank's loss reached `bucket` since the gradients were last set to None, agreed by every rank
        in gradient turn `ticket`; the pieces of the slots no rank reached lose their `.grad` until one does. Plain
        torch on the global batch leaves such a parameter's `.grad` None, and so does DDP for a parameter no rank
        used (its reducer copies no reduced gradient into it): no weight decay, no moments, no step count. Each
        rank knows only its own slots (`Bucket.reached_slots`: [Note: parameters without a gradient]), so the
        ranks sum their flags, one small all-reduce per bucket and step. The answer also decides, the same way on
        every rank, whether the bucket's gradients are reduced at all: a bucket one rank's loss never reached
        (a layer that rank's data skipped) still joins its peers' reduce-scatter, with zeros, where deciding on
        the rank's own flags paired one rank's reduce-scatter of one bucket with another's of the next (the same
        sizes, so nothing failed: the weights were silently wrong). The clip's measure agrees in its turn; the
        step in the turn right after it takes that answer (no gradient came between: the tickets are program
        order)."""
        shard = self.shards[bucket.index]
        if shard.reached_at is not None and shard.reached_at in (ticket, ticket - 1):
            shard.reached_at = ticket
            return any(shard.reached)
        flags = torch.zeros(len(bucket.slots), dtype=torch.int32)
        flags[sorted(bucket.reached_slots())] = 1
        self.group.sum_tensor_on_optimizer_thread(flags, f"the agreement on which parameters of {bucket} the losses "
                                                         f"reached")
        shard.reached = tuple(bool(count) for count in flags.tolist())
        shard.reached_at = ticket
        for slot_index, piece, grad in shard.slot_pieces:
            piece.grad = grad if shard.reached[slot_index] else None
        return any(shard.reached)

    def holds_gradient(self, bucket: Bucket) -> bool:
        """Whether this rank's range holds a reduced gradient to scale (the last agreement's answer)."""
        return any(self.shards[bucket.index].reached)

    def _reduce(self, bucket: Bucket, ticket: int) -> None:
        """This rank's range of the sum over ranks of `bucket`'s gradients, in its gradient turn `ticket`; a rank
        whose loss did not reach the bucket adds zeros ([Note: parameters no rank reaches])."""
        shard = self.shards[bucket.index]
        flat = bucket.grad if bucket.grad_valid else torch.zeros(bucket.optim.numel(), dtype=shard.grad.dtype)
        with maybe_span(self.trace, "optimizer", f"reduce-scatter layers {list(bucket.layers)}"):
            self.group.reduce_scatter(shard.grad, flat, f"the gradients of {bucket}")
        shard.reduced_at = ticket

    def prepare_step(self, bucket: Bucket, ticket: int) -> None:
        """Reduce `bucket`'s gradients unless the clip did in the turn just before (gradients added after it need
        another reduction); the tickets are program order, the same on every rank. Only where `has_gradient`."""
        if self.shards[bucket.index].reduced_at != ticket - 1:
            self._reduce(bucket, ticket)

    def squared_norm(self, bucket: Bucket, ticket: int) -> float:
        if not self.has_gradient(bucket, ticket):
            return 0.0
        self._reduce(bucket, ticket)  # the norm is the reduced (global) gradient's
        return self.shards[bucket.index].squared_norm()

    def scale(self, bucket: Bucket, coefficient: float) -> None:
        self.shards[bucket.index].grad.mul_(coefficient)

    def scaled_in_kernel(self, bucket: Bucket, coefficient: float) -> None:
        """The kernel scaled this rank's reduced range, not the bucket's own gradients: nothing to record."""

    def finish_step(self, bucket: Bucket) -> None:
        """Every rank's stepped range into every rank's optimizer copy."""
        with maybe_span(self.trace, "optimizer", f"all-gather layers {list(bucket.layers)}"):
            self.group.all_gather(bucket.optim, f"the stepped weights of {bucket}")

    def __repr__(self) -> str:
        return f"ShardedSteps({self.group})"

    @staticmethod
    def _hyper(group: dict[str, Any]) -> dict[str, Any]:
        """One group's settings, as `step()` reads them (a tensor cloned)."""
        return hyper_parameters([group])[0]

    @property
    def layout(self) -> list[list]:
        """What this rank's shard holds, for a checkpoint: per shard parameter, its bucket, name and range."""
        return [[p.bucket_index, p.slot_name, p.start, p.end] for p in self._pieces]

    def release(self) -> None:
        """The engine closed: let go of the shard optimizer (its state and its views of the optimizer copies), the
        shards' gradients and the steppers ([Note: memory freed at close]); nothing steps afterwards."""
        self.optimizer.state.clear()
        self.optimizer.param_groups = []
        self.shards.clear()
        self._pieces_of_param.clear()
        self._pieces = []
        self.steppers = None

    def state_dict(self) -> dict[str, Any]:
        for mine, theirs in zip(self.optimizer.param_groups, self.user.param_groups):
            mine.update(self._hyper(theirs))  # an LR scheduler wrote the user's groups
        return {"data_parallel": {"world_size": self.group.world_size, "rank": self.group.rank,
                                  "layout": self.layout},
                "shard": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        meta = state.get("data_parallel")
        if meta is None:
            state = self._shard_of_full(state)
        elif meta["world_size"] != self.group.world_size or meta["rank"] != self.group.rank:
            raise DataParallelError(
                f"this optimizer state is rank {meta['rank']}'s shard of a run with {meta['world_size']} data-parallel "
                f"processes; this is rank {self.group.rank} of {self.group.world_size}. A sharded optimizer state "
                f"resumes only with the same number of processes, each loading its own rank's file (the weights "
                f"load at any world size). Resume with {meta['world_size']} processes.")
        elif [list(entry) for entry in meta["layout"]] != self.layout:
            raise DataParallelError(
                "this optimizer state's shard layout differs from this engine's (another model, another parameter "
                "grouping, or another version of RoundPipe saved it): resume with the model and optimizer groups "
                "that saved it.")
        else:
            state = state["shard"]
        self.optimizer.load_state_dict(state)
        for theirs, mine in zip(self.user.param_groups, self.optimizer.param_groups):
            theirs.update(self._hyper(mine))
        prefer_fused(self.user)  # the groups `step()` reads: a plain state dict's fused=None would unfuse them
        self.steppers.share_state(self.optimizer.state)

    def _shard_of_full(self, full: dict[str, Any]) -> dict[str, Any]:
        """A one-process state dict (the user's optimizer's format) cut to this rank's ranges."""
        params = [p for g in self.user.param_groups for p in g["params"]]
        if len(full["param_groups"]) != len(self.user.param_groups) or \
                sum(len(g["params"]) for g in full["param_groups"]) != len(params):
            raise ValueError("the optimizer state has other parameter groups than this optimizer; load the state of "
                             "an optimizer built over the same parameters and groups.")
        index_of_piece = {id(p.param): i for i, p in enumerate(self._pieces)}
        saved_ids = [i for g in full["param_groups"] for i in g["params"]]
        state: dict[int, dict[str, Any]] = {}
        for saved_id, param in zip(saved_ids, params):
            values = full["state"].get(saved_id)
            if values is None:
                continue
            for piece in self._pieces_of_param.get(id(param), []):
                state[index_of_piece[id(piece.param)]] = {
                    k: (v.reshape(-1)[piece.start:piece.end].clone()
                        if torch.is_tensor(v) and v.dim() > 0 and v.numel() == param.numel() else
                        (v.clone() if torch.is_tensor(v) else v))
                    for k, v in values.items()}
        groups, first = [], 0
        for saved, mine in zip(full["param_groups"], self.optimizer.param_groups):
            groups.append(dict(self._hyper(saved), params=list(range(first, first + len(mine["params"])))))
            first += len(mine["params"])
        return {"state": state, "param_groups": groups}


def full_state_of_shards(shards: list[dict[str, Any]], store: HostStore,
                         user: torch.optim.Optimizer) -> dict[str, Any]:
    """The one-process state dict of `user` (its own format, over the optimizer copies of `store`) that the shards
    of every rank of one data-parallel run hold together ([Note: shards of another world size])."""
    metas = [state.get("data_parallel") if isinstance(state, dict) else None for state in shards]
    if any(meta is None for meta in metas):
        raise ValueError("full_state_of_shards takes the optimizer state of every rank of a data-parallel run (each "
                         "rank's `optimizer.state_dict()`); one of them is not a shard.")
    world_sizes = sorted({meta["world_size"] for meta in metas})
    ranks = sorted(meta["rank"] for meta in metas)
    if len(world_sizes) != 1 or ranks != list(range(world_sizes[0])):
        raise DataParallelError(
            f"these optimizer shards are ranks {ranks} of runs with {world_sizes} data-parallel processes; loading "
            f"them into another number of processes needs the shard of every rank of one run (all of its "
            f"`optimizer.rank<r>-of-<n>` files).")
    # Per parameter (slot name), its pieces across the ranks: (start, end, that piece's state or None).
    pieces: dict[str, list[tuple[int, int, dict[str, Any] | None]]] = {}
    for state in shards:
        saved = state["shard"]["state"]
        for index, (_, name, start, end) in enumerate(state["data_parallel"]["layout"]):
            pieces.setdefault(name, []).append((start, end, saved.get(index)))
    name_of = {id(slot.optim): slot.name for bucket in store.trainable_buckets for slot in bucket.slots}
    params = [p for group in user.param_groups for p in group["params"]]
    full: dict[int, dict[str, Any]] = {}
    for index, param in enumerate(params):
        got = sorted(pieces.pop(name_of[id(param)], []), key=lambda piece: piece[0])
        if all(values is None for _, _, values in got):
            continue  # never stepped (or no piece): no state, as on one process
        name = name_of[id(param)]
        bounds = [(start, end) for start, end, _ in got]
        covered = bounds[0][0] == 0 and bounds[-1][1] == param.numel() and \
            all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        if not covered or any(values is None for _, _, values in got):
            raise DataParallelError(
                f"the optimizer shards do not hold the whole state of parameter {name} ({param.numel()} elements; "
                f"they hold {bounds}): another model or another parameter grouping saved them. Resume with the "
                f"model and optimizer groups that saved them.")
        full[index] = {key: _joined(key, [(end - start, values) for start, end, values in got], param)
                       for key in got[0][2]}
    if pieces:
        raise DataParallelError(
            f"the optimizer shards hold state for {len(pieces)} parameter(s) this optimizer does not step (e.g. "
            f"{next(iter(pieces))}): another model or another parameter grouping saved them.")
    saved_groups = shards[0]["shard"]["param_groups"]
    if len(saved_groups) != len(user.param_groups):
        raise DataParallelError(f"the optimizer shards have {len(saved_groups)} parameter groups, this optimizer "
                                f"{len(user.param_groups)}: build it with the groups that saved them.")
    groups, first = [], 0
    for saved, mine in zip(saved_groups, user.param_groups):
        groups.append(dict(ShardedSteps._hyper(saved), params=list(range(first, first + len(mine["params"])))))
        first += len(mine["params"])
    return {"state": full, "param_groups": groups}


def _joined(key: str, parts: list[tuple[int, dict[str, Any]]], param: torch.Tensor) -> Any:
    """One state entry of a whole parameter from its pieces': element-wise tensors (a moment) are concatenated in
    range order; anything else (a step count) is the same on every rank and taken from the first."""
    first = parts[0][1][key]
    if torch.is_tensor(first) and first.dim() > 0 and all(
            values[key].numel() == length for length, values in parts):
        return torch.cat([values[key].reshape(-1) for _, values in parts]).reshape(param.shape)  # cat made new memory
    return first.clone() if torch.is_tensor(first) else first
