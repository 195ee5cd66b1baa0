"""What a checkpoint holds of the engine besides the module's weights and the optimizer's state: the pass counts that
key the layers' RNG streams, where the round-robin dispatch stands, the optimizer's step count, the full-precision
optimizer copies and, with the lagged step, the compute copies the next pass computes with. The engine keeps thin
public methods (`engine_state`, `load_engine_state`, `load_optimizer_copies`, `lagged_weights`,
`load_lagged_weights`) that call these after `synchronize()`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from .dispatch import Dispatcher
from .host_store import HostStore
from .optimizer import RoundPipeOptimizer


class PassCounts:
    """The base seed and the pass counts of [Note: RNG streams of passes] (runtime/rng_streams.py): owned by the engine,
    counted on the caller's thread, saved and loaded with a checkpoint."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.num_passes = 0
        # The RNG streams' keys: training passes and evaluation passes count apart.
        self.training_passes = 0
        self.evaluation_passes = 0

    def new_pass_index(self) -> int:
        self.num_passes += 1
        return self.num_passes - 1

    def new_rng_stream(self, training: bool) -> int:
        """The key of a pass's RNG streams: training passes count on their own, so an evaluation pass between them
        changes no later dropout mask."""
        if training:
            self.training_passes += 1
            return self.training_passes - 1
        self.evaluation_passes += 1
        return -self.evaluation_passes

    def state(self) -> dict[str, int]:
        return {"seed": self.seed, "num_passes": self.num_passes, "training_passes": self.training_passes,
                "evaluation_passes": self.evaluation_passes}

    def load(self, state: dict[str, int]) -> None:
        self.seed = int(state["seed"])
        self.num_passes = int(state["num_passes"])
        # A checkpoint from before passes were counted apart keyed the streams on every pass.
        self.training_passes = int(state.get("training_passes", state["num_passes"]))
        self.evaluation_passes = int(state.get("evaluation_passes", 0))


def engine_state(counts: PassCounts, dispatch: Dispatcher, optimizer: RoundPipeOptimizer | None) -> dict[str, int]:
    state = {**counts.state(), "next_device": dispatch.next_device}
    if optimizer is not None:
        state["optimizer_steps"] = optimizer.steps_taken  # where an async warm-up stands
    return state


def load_engine_state(state: dict[str, int], counts: PassCounts, dispatch: Dispatcher,
                      optimizer: RoundPipeOptimizer | None) -> None:
    counts.load(state)
    dispatch.resume_at(int(state["next_device"]))
    dispatch.reseed(counts.seed)
    if optimizer is not None and "optimizer_steps" in state:
        optimizer.resume_steps(int(state["optimizer_steps"]))


def load_optimizer_copies(tensors: dict[str, torch.Tensor], named_parameters: Iterator[tuple[str, nn.Parameter]],
                          store: HostStore, optimizer: RoundPipeOptimizer | None) -> None:
    if optimizer is not None:
        optimizer.forget_stashes()
    with torch.no_grad():
        for name, p in named_parameters:
            if p.requires_grad and name in tensors:
                p.copy_(tensors[name])
    for bucket in store.trainable_buckets:
        bucket.versions.loaded_from_optim()


@contextlib.contextmanager
def loading_compute_copies(store: HostStore, optimizer: RoundPipeOptimizer | None) -> Iterator[None]:
    """Around a load into the compute copies (`load_state_dict`): the optimizer copies follow them, and no stash of a
    held step outlives the weights it was of."""
    if optimizer is not None:
        optimizer.forget_stashes()
    yield
    for bucket in store.trainable_buckets:
        bucket.versions.loaded_from_compute()


def lagged_weights(store: HostStore) -> dict[str, torch.Tensor]:
    return {str(b.index): b.stash.clone() for b in store.buckets if b.stash is not None}


def load_lagged_weights(tensors: dict[str, torch.Tensor], store: HostStore,
                        optimizer: RoundPipeOptimizer | None) -> None:
    if optimizer is None:
        raise RuntimeError("load the lagged weights after engine.wrap_optimizer(...): they belong to its held step.")
    if not optimizer.async_step:
        return  # resumed with the exact step: the next pass computes with the newest weights, already loaded
    buckets = []
    for key, tensor in tensors.items():
        bucket = store.buckets[int(key)]
        if tensor.shape != bucket.compute.shape:
            raise ValueError(f"lagged weights of {bucket} have shape {tuple(tensor.shape)}, expected "
                             f"{tuple(bucket.compute.shape)}: the checkpoint is of another model.")
        bucket.versions.restore_stash(tensor)
        buckets.append(bucket)
    optimizer.hold_shown(buckets)
