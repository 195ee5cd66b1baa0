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

from ..execution.dispatch import Dispatcher
from ..optimizer.optimizer import RoundPipeOptimizer
from ..state.host_store import HostStore


class PassCounts:
    """The base seed and the pass counts of [Note: RNG streams of passes] (runtime/execution/rng_streams.py): owned by
    the engine, counted on the caller's thread, saved and loaded with a checkpoint."""

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


# [Note: engine state ranges]
# An engine state comes back from a file anyone can edit (`roundpipe_engine_state.json`) or from a caller, and every
# value in it is used as it is: the seed keys the RNG streams, the pass counts key each pass's streams, the step
# count decides the async warm-up, the device index starts the next pass. So each is checked against the range the
# engine can produce before any is loaded: the seed is a seed of torch's (0 to 2**64 - 1, as `RoundPipeConfig.seed`);
# the counts are 64-bit (a pass a microsecond for 290,000 years), and the training and evaluation passes add up to
# all passes, as `PassCounts` counts them; the device index is one of the `num_devices` devices of the run that
# saved it (recorded since it was checked; a state without it is checked against this engine's devices). A resume
# on another number of devices starts at that index modulo the device count, as before.
MAX_SEED = 2**64 - 1
MAX_COUNT = 2**63 - 1
MAX_DEVICES = 2**16
COUNTS = ("num_passes", "training_passes", "evaluation_passes", "optimizer_steps")
REQUIRED = ("seed", "num_passes", "next_device")  # always in `engine_state()`; older states lack the others


def engine_state(counts: PassCounts, dispatch: Dispatcher, optimizer: RoundPipeOptimizer | None) -> dict[str, int]:
    state = {**counts.state(), "next_device": dispatch.next_device, "num_devices": len(dispatch.devices)}
    if optimizer is not None:
        state["optimizer_steps"] = optimizer.steps_taken  # where an async warm-up stands
    return state


def engine_state_problems(state: dict, num_devices: int) -> list[str]:
    """What makes `state` no engine state this engine (of `num_devices` devices) could have saved, one phrase per
    field ([Note: engine state ranges]); empty when it loads."""
    problems = [f"no `{key}`" for key in REQUIRED if key not in state]

    def whole(key: str, least: int, most: int) -> bool:
        value = state.get(key)
        if key not in state or (isinstance(value, int) and not isinstance(value, bool) and least <= value <= most):
            return True
        shown = repr(value) if len(repr(value)) <= 40 else f"{repr(value)[:37]}..."
        problems.append(f"`{key}` = {shown}, not a whole number from {least} to {most}")
        return False

    whole("seed", 0, MAX_SEED)
    counts_ok = all([whole(key, 0, MAX_COUNT) for key in COUNTS])
    saved_devices = num_devices
    if whole("num_devices", 1, MAX_DEVICES) and "num_devices" in state:
        saved_devices = state["num_devices"]
    of = "`num_devices`" if "num_devices" in state else "this engine's device count"
    if whole("next_device", 0, MAX_DEVICES - 1) and state.get("next_device", 0) >= saved_devices:
        problems.append(f"`next_device` = {state['next_device']}, not a device index below {of} ({saved_devices})")
    if counts_ok and "num_passes" in state:
        training, evaluation = state.get("training_passes", state["num_passes"]), state.get("evaluation_passes", 0)
        if training + evaluation != state["num_passes"]:
            problems.append(f"`training_passes` ({training}) + `evaluation_passes` ({evaluation}) != `num_passes` "
                            f"({state['num_passes']}): every pass is one or the other")
    return problems


def load_engine_state(state: dict[str, int], counts: PassCounts, dispatch: Dispatcher,
                      optimizer: RoundPipeOptimizer | None) -> None:
    problems = engine_state_problems(state, len(dispatch.devices))
    if problems:
        raise ValueError(f"this engine state has {'; '.join(problems)}: it is not an engine state RoundPipe saved "
                         f"([Note: engine state ranges]); load the dict `engine.engine_state()` returned.")
    counts.load(state)
    dispatch.resume_at(int(state["next_device"]))
    dispatch.reseed(counts.seed)
    if optimizer is not None and "optimizer_steps" in state:
        optimizer.resume_steps(int(state["optimizer_steps"]))


def load_optimizer_copies(tensors: dict[str, torch.Tensor], named_parameters: Iterator[tuple[str, nn.Parameter]],
                          store: HostStore, optimizer: RoundPipeOptimizer | None) -> None:
    if optimizer is not None:
        optimizer.forget_stashes()
    values = {id(p): tensors[name] for name, p in named_parameters if p.requires_grad and name in tensors}
    for bucket in store.trainable_buckets:
        with bucket.tier.resident(bucket), torch.no_grad():  # one bucket in memory at a time ([Note: disk tier])
            for slot in bucket.slots:
                if id(slot.optim) in values:
                    slot.optim.copy_(values[id(slot.optim)])
            bucket.versions.loaded_from_optim()


def optimizer_copies(named_parameters: Iterator[tuple[str, nn.Parameter]], store: HostStore) -> dict[str, torch.Tensor]:
    """The trainable optimizer copies by name, as new host tensors, read where their tier keeps them (a disk
    bucket's from its file: [Note: disk tier])."""
    where = {id(slot.optim): (bucket, slot) for bucket in store.trainable_buckets for slot in bucket.slots}
    flats: dict[int, torch.Tensor] = {}
    out = {}
    for name, p in named_parameters:
        if not p.requires_grad or id(p) not in where:
            continue
        bucket, slot = where[id(p)]
        if bucket.index not in flats:
            flats[bucket.index] = bucket.tier.optim_values(bucket)
        view = flats[bucket.index][slot.offset:slot.offset + slot.numel].view(slot.shape)
        out[name] = view.detach().to("cpu", copy=True)
    return out


@contextlib.contextmanager
def loading_compute_copies(store: HostStore, optimizer: RoundPipeOptimizer | None) -> Iterator[None]:
    """Around a load into the compute copies (`load_state_dict`): the optimizer copies follow them, and no stash of a
    held step outlives the weights it was of."""
    if optimizer is not None:
        optimizer.forget_stashes()
    yield
    for bucket in store.trainable_buckets:
        with bucket.tier.resident(bucket):  # one bucket in memory at a time ([Note: disk tier])
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
