"""The files RoundPipe writes into a checkpoint beside the model and the optimizer, and reading them back checked.

[Note: checkpoint files]
Into a checkpoint (the Trainer's `checkpoint-N/`, accelerate's `save_state` directory) RoundPipe writes, per engine
(suffix `_<model index>` after the first, in `save_state`) and per rank (`.rank<r>-of-<n>`, several processes only):
- `roundpipe_engine_state.json`: the RNG seed, pass counts, dispatch position (and device count), the optimizer
  steps taken, and `files`: which of the two files below were written. It is written last, so it also marks the
  others complete;
- `roundpipe_optimizer_copies.safetensors`: the optimizer copies, when the compute copies are narrower;
- `roundpipe_lagged_weights.safetensors`: under the lagged step, the weights the next pass computes with.
With several processes the Trainer and the accelerator also write each rank's optimizer shard,
`optimizer.rank<r>-of-<n>.pt` / `.bin`, read by `read_optimizer_shard` (a missing one: `missing_shard_error`).
On resume every one of them is read whole and checked against the engine before any is loaded. One that is missing
(listed in the engine state, or the engine state itself beside the others), truncated, unreadable or not of this
model raises `CheckpointError`, naming the file, the checkpoint and what to do; never a bare `JSONDecodeError` or
a shape mismatch from deep inside a copy. What sizes anything is checked before it does: a per-rank name's world
size (1 to `MAX_WORLD_SIZE`) and rank, a shard's own world size, rank (the one its name says) and layout, the engine
state's size (`MAX_ENGINE_STATE_BYTES`), nesting and counters ([Note: engine state ranges]). A checkpoint holding
none of them (written without RoundPipe) loads without them, as before.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import torch

from ..runtime import RoundPipe
from ..runtime.engine.engine_checkpoint import engine_state_problems

OPTIMIZER_COPIES_FILE = "roundpipe_optimizer_copies{suffix}.safetensors"
# The weights the next pass computes with under the lagged step, one step older than the saved model
# ([Note: looking changes nothing]): a resume then follows the uninterrupted run exactly.
LAGGED_WEIGHTS_FILE = "roundpipe_lagged_weights{suffix}.safetensors"
ENGINE_STATE_FILE = "roundpipe_engine_state{suffix}.json"
# The key of the engine state listing the other files written with it.
FILES_KEY = "files"
# One process per machine: no run has more (a per-rank file naming more is damaged, and is refused before anything
# is sized by it).
MAX_WORLD_SIZE = 2**20
_SHARD_NAME = re.compile(r"\.rank([0-9]+)-of-([0-9]+)\.[^.]+$")
# Far above what `write_engine_state` writes (a few hundred bytes): a file larger is refused before it is parsed.
MAX_ENGINE_STATE_BYTES = 64 * 1024


class CheckpointError(ValueError):
    """A file RoundPipe wrote into a checkpoint is missing, truncated, unreadable or does not belong with the rest
    ([Note: checkpoint files]). `path` is the file, `checkpoint` its directory."""

    def __init__(self, path: str, problem: str) -> None:
        self.path = path
        self.checkpoint = os.path.dirname(path)
        super().__init__(
            f"{os.path.basename(path)} in the checkpoint {self.checkpoint} {problem}. The checkpoint cannot be "
            f"resumed exactly: resume from the previous checkpoint (resume_from_checkpoint=<its directory>, or "
            f"accelerator.load_state(<its directory>)), or start the run over without resuming.")


@dataclass
class EngineExtras:
    """What a checkpoint's RoundPipe files hold for one engine, read and checked; None where not written."""

    engine_state: dict | None = None
    optimizer_copies: dict[str, torch.Tensor] | None = None
    lagged_weights: dict[str, torch.Tensor] | None = None


def file_paths(directory: str, suffix: str) -> tuple[str, str, str]:
    """The engine state, optimizer copies and lagged weights files of one engine (and rank) in `directory`."""
    return tuple(os.path.join(directory, name.format(suffix=suffix))
                 for name in (ENGINE_STATE_FILE, OPTIMIZER_COPIES_FILE, LAGGED_WEIGHTS_FILE))


def write_engine_state(path: str, state: dict, written: list[str]) -> None:
    """The engine state, listing the files written with it (by name): written after them
    ([Note: checkpoint files])."""
    with open(path, "w") as f:
        json.dump({**state, FILES_KEY: [os.path.basename(p) for p in written]}, f)


def read_engine_extras(engine: RoundPipe, directory: str, suffix: str = "") -> EngineExtras:
    """Every RoundPipe file of `engine` in the checkpoint `directory`, read and checked against the engine; raises
    `CheckpointError` for the first that is missing, damaged or of another model."""
    state_path, copies_path, lagged_path = file_paths(directory, suffix)
    present = [p for p in (copies_path, lagged_path) if os.path.isfile(p)]
    if not os.path.isfile(state_path):
        if present:
            names = " and ".join(os.path.basename(p) for p in present)
            raise CheckpointError(state_path, f"is missing, though {names} beside it is there: the checkpoint was "
                                              f"not completely written")
        return EngineExtras()  # not written by RoundPipe
    state = _read_engine_state(state_path, len(engine.devices))
    listed = state.pop(FILES_KEY, None)
    if listed is not None:  # checkpoints written before the list load whatever is there
        for path in (copies_path, lagged_path):
            if os.path.basename(path) in listed and path not in present:
                raise CheckpointError(path, f"is missing, though {os.path.basename(state_path)} lists it as written")
            if os.path.basename(path) not in listed and path in present:
                raise CheckpointError(path, f"was not written with this checkpoint ({os.path.basename(state_path)} "
                                            f"does not list it): it is left from another save")
    extras = EngineExtras(engine_state=state)
    if copies_path in present:
        extras.optimizer_copies = _read_tensors(copies_path)
        _check_optimizer_copies(engine, extras.optimizer_copies, copies_path)
    if lagged_path in present:
        extras.lagged_weights = _read_tensors(lagged_path)
        _check_lagged_weights(engine, extras.lagged_weights, lagged_path)
    return extras


def read_optimizer_shard(path: str) -> dict:
    """One rank's optimizer state (`optimizer.rank<r>-of-<n>.pt` / `.bin`, [Note: one process per machine]; or the
    one-process `optimizer.pt` / `.bin` joined into several), read whole and its structure checked: one truncated,
    not a saved state, or a shard of another rank than its name says raises `CheckpointError` (a missing one: the
    caller's `missing_shard_error`, which says which world size wrote the checkpoint)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as error:  # torch.load raises RuntimeError, UnpicklingError, EOFError, ... by what is wrong
        raise CheckpointError(path, f"cannot be read (truncated or not a saved optimizer state: {error})") from error
    if not isinstance(state, dict):
        raise CheckpointError(path, f"holds a {type(state).__name__}, not an optimizer's state_dict")
    meta = state.get("data_parallel")
    if meta is None:
        _check_optimizer_state_dict(path, state, "")
        return state
    _check_shard_meta(path, meta)
    _check_optimizer_state_dict(path, state.get("shard"), "`shard` ")
    return state


def shard_name_ranks(name: str) -> tuple[int, int] | None:
    """(rank, world size) a per-rank file name says (`optimizer.rank1-of-2.bin` -> (1, 2)), None for another name.
    The numbers as written, unchecked: `check_shard_name` checks them."""
    match = _SHARD_NAME.search(name)
    return (int(match[1]), int(match[2])) if match else None


def check_shard_name(path: str, rank: int, world_size: int) -> None:
    """A per-rank file's rank and world size (from its name) are those of a run RoundPipe could have written:
    checked before anything is sized by them ([Note: checkpoint files])."""
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise CheckpointError(path, f"names a run of {world_size} processes, but a run has 1 to {MAX_WORLD_SIZE} "
                                    f"(one per machine): the name is damaged or not RoundPipe's")
    if rank >= world_size:
        raise CheckpointError(path, f"names rank {rank} of a run of {world_size} processes, whose ranks are 0 to "
                                    f"{world_size - 1}: the name is damaged or not RoundPipe's")


def _check_shard_meta(path: str, meta) -> None:
    """A shard's `data_parallel` entry: its world size, rank and layout ([Note: shards of another world size])."""
    if not isinstance(meta, dict) or not all(_is_int(meta.get(key)) for key in ("world_size", "rank")):
        raise CheckpointError(path, "has a `data_parallel` entry without a whole-number world_size and rank: it is "
                                    "not a shard RoundPipe saved")
    check_shard_name(path, meta["rank"], meta["world_size"])
    if meta["rank"] < 0:
        raise CheckpointError(path, f"holds the shard of rank {meta['rank']}: it is not a shard RoundPipe saved")
    named = shard_name_ranks(os.path.basename(path))
    if named is not None and named != (meta["rank"], meta["world_size"]):
        raise CheckpointError(path, f"holds the shard of rank {meta['rank']} of {meta['world_size']} processes, but "
                                    f"its name says rank {named[0]} of {named[1]}: it was renamed or copied from "
                                    f"another checkpoint")
    layout = meta.get("layout")
    if not isinstance(layout, list) or not all(
            isinstance(entry, (list, tuple)) and len(entry) == 4 and _is_int(entry[0]) and isinstance(entry[1], str)
            and _is_int(entry[2]) and _is_int(entry[3]) and 0 <= entry[0] and 0 <= entry[2] <= entry[3]
            for entry in layout):
        raise CheckpointError(path, "has a shard layout that is not a list of [bucket, parameter name, start, end] "
                                    "(whole numbers, 0 <= start <= end): it is not a shard RoundPipe saved")


def _check_optimizer_state_dict(path: str, state, what: str) -> None:
    """The shape of torch's `Optimizer.state_dict()`: a `state` dict of dicts and `param_groups`, a list of dicts
    each with its `params` list."""
    groups = state.get("param_groups") if isinstance(state, dict) else None
    per_param = state.get("state") if isinstance(state, dict) else None
    if not (isinstance(per_param, dict) and all(isinstance(v, dict) for v in per_param.values())
            and isinstance(groups, list) and groups
            and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)):
        raise CheckpointError(path, f"holds {what}no optimizer state_dict (a `state` dict and `param_groups`, a list "
                                    f"of dicts each with its `params`): it is not a saved optimizer state")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _read_engine_state(path: str, num_devices: int) -> dict:
    """The engine state in `path`, every field in its range for an engine of `num_devices` devices
    ([Note: engine state ranges]); the file's size and nesting are bounded before it is parsed."""
    try:
        size = os.path.getsize(path)
    except OSError as error:
        raise CheckpointError(path, f"cannot be read ({error})") from error
    if size > MAX_ENGINE_STATE_BYTES:
        raise CheckpointError(path, f"is {size} bytes, but RoundPipe's engine state is a few hundred (at most "
                                    f"{MAX_ENGINE_STATE_BYTES}): it is not RoundPipe's engine state")
    try:
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
    except (OSError, ValueError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(path, f"cannot be read (truncated or not RoundPipe's JSON: {error})") from error
    except RecursionError as error:  # nested deeper than the parser's stack: RoundPipe's state is one level deep
        raise CheckpointError(path, "is nested too deeply to be read: it is not RoundPipe's engine state") from error
    if not isinstance(state, dict):
        raise CheckpointError(path, f"holds a JSON {type(state).__name__}, not RoundPipe's engine state")
    problems = engine_state_problems({k: v for k, v in state.items() if k != FILES_KEY}, num_devices)
    if problems:
        raise CheckpointError(path, f"has {'; '.join(problems)}: it is not RoundPipe's engine state, or was edited")
    listed = state.get(FILES_KEY)
    if listed is not None and not (isinstance(listed, list) and all(isinstance(n, str) for n in listed)):
        raise CheckpointError(path, f"has a `{FILES_KEY}` entry that is not a list of file names")
    return state


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except Exception as error:  # safetensors raises its own SafetensorError (an Exception), OSError, ...
        raise CheckpointError(path, f"cannot be read (truncated or not a safetensors file: {error})") from error


def _check_optimizer_copies(engine: RoundPipe, tensors: dict[str, torch.Tensor], path: str) -> None:
    expected = {name: p for name, p in engine.named_parameters() if p.requires_grad}
    missing = sorted(expected.keys() - tensors.keys())
    unknown = sorted(tensors.keys() - expected.keys())
    if missing or unknown:
        what = f"has no copy of {_few(missing)}" if missing else \
            f"holds {_few(unknown)}, which this model does not train"
        raise CheckpointError(path, f"{what}: it was written for another model")
    for name, p in expected.items():
        tensor = tensors[name]
        if tensor.shape != p.shape or tensor.dtype != p.dtype:  # another dtype would be rounded into the copy
            raise CheckpointError(path, f"holds {name} as {tuple(tensor.shape)} {tensor.dtype}, but this model's "
                                        f"is {tuple(p.shape)} {p.dtype}: it was written for another model")


def _check_lagged_weights(engine: RoundPipe, tensors: dict[str, torch.Tensor], path: str) -> None:
    buckets = engine.host_store.buckets
    for key, tensor in tensors.items():
        # A bucket index as `lagged_weights` writes it (a long digit string would not even convert).
        index = int(key) if key.isascii() and key.isdigit() and len(key) <= len(str(len(buckets))) else -1
        if not 0 <= index < len(buckets):
            shown = key if len(key) <= 20 else f"{key[:17]}..."
            raise CheckpointError(path, f"holds weights for bucket {shown!r}, but this model's host store has buckets "
                                        f"0-{len(buckets) - 1}: it was written for another model or settings")
        compute = buckets[index].compute
        if tensor.shape != compute.shape or tensor.dtype != compute.dtype:
            raise CheckpointError(path, f"holds bucket {index} as {tuple(tensor.shape)} {tensor.dtype}, but this "
                                        f"model's is {tuple(compute.shape)} {compute.dtype}: it was written for "
                                        f"another model or settings")


def _few(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
