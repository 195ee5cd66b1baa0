"""The files RoundPipe writes into a checkpoint beside the model and the optimizer, and reading them back checked.

[Note: checkpoint files]
Into a checkpoint (the Trainer's `checkpoint-N/`, accelerate's `save_state` directory) RoundPipe writes, per engine
(suffix `_<model index>` after the first, in `save_state`) and per rank (`.rank<r>-of-<n>`, several processes only):
- `roundpipe_engine_state.json`: the RNG seed, pass count, dispatch position and optimizer steps taken, and `files`:
  which of the two files below were written. It is written last, so it also marks the others complete;
- `roundpipe_optimizer_copies.safetensors`: the optimizer copies, when the compute copies are narrower;
- `roundpipe_lagged_weights.safetensors`: under the lagged step, the weights the next pass computes with.
With several processes the Trainer and the accelerator also write each rank's optimizer shard,
`optimizer.rank<r>-of-<n>.pt` / `.bin`, read by `read_optimizer_shard` (a missing one: `missing_shard_error`).
On resume every one of them is read whole and checked against the engine before any is loaded. One that is missing
(listed in the engine state, or the engine state itself beside the others), truncated, unreadable or not of this
model raises `CheckpointError`, naming the file, the checkpoint and what to do; never a bare `JSONDecodeError` or
a shape mismatch from deep inside a copy. A checkpoint holding none of them (written without RoundPipe) loads
without them, as before.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from ..runtime import RoundPipe

OPTIMIZER_COPIES_FILE = "roundpipe_optimizer_copies{suffix}.safetensors"
# The weights the next pass computes with under the lagged step, one step older than the saved model
# ([Note: looking changes nothing]): a resume then follows the uninterrupted run exactly.
LAGGED_WEIGHTS_FILE = "roundpipe_lagged_weights{suffix}.safetensors"
ENGINE_STATE_FILE = "roundpipe_engine_state{suffix}.json"
# The key of the engine state listing the other files written with it.
FILES_KEY = "files"
_COUNTERS = ("seed", "num_passes", "next_device")  # always in `engine.engine_state()`; "optimizer_steps" may be


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
    state = _read_engine_state(state_path)
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
    """One rank's optimizer state (`optimizer.rank<r>-of-<n>.pt` / `.bin`, [Note: one process per machine]), read
    whole; one truncated or not a saved state raises `CheckpointError` (a missing one: the caller's
    `missing_shard_error`, which says which world size wrote the checkpoint)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as error:  # torch.load raises RuntimeError, UnpicklingError, EOFError, ... by what is wrong
        raise CheckpointError(path, f"cannot be read (truncated or not a saved optimizer state: {error})") from error
    if not isinstance(state, dict):
        raise CheckpointError(path, f"holds a {type(state).__name__}, not an optimizer's state_dict")
    return state


def _read_engine_state(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
    except (OSError, ValueError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(path, f"cannot be read (truncated or not RoundPipe's JSON: {error})") from error
    if not isinstance(state, dict):
        raise CheckpointError(path, f"holds a JSON {type(state).__name__}, not RoundPipe's engine state")
    wrong = [key for key in _COUNTERS if not _is_count(state.get(key))]
    if "optimizer_steps" in state and not _is_count(state["optimizer_steps"]):
        wrong.append("optimizer_steps")
    if wrong:
        raise CheckpointError(path, f"has no valid {', '.join(wrong)} (each a whole number >= 0): it is not "
                                    f"RoundPipe's engine state, or was edited")
    listed = state.get(FILES_KEY)
    if listed is not None and not (isinstance(listed, list) and all(isinstance(n, str) for n in listed)):
        raise CheckpointError(path, f"has a `{FILES_KEY}` entry that is not a list of file names")
    return state


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


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
        if tensor.shape != p.shape or not tensor.is_floating_point():
            raise CheckpointError(path, f"holds {name} as {tuple(tensor.shape)} {tensor.dtype}, but this model's "
                                        f"is {tuple(p.shape)} {p.dtype}: it was written for another model")


def _check_lagged_weights(engine: RoundPipe, tensors: dict[str, torch.Tensor], path: str) -> None:
    buckets = engine.host_store.buckets
    for key, tensor in tensors.items():
        index = int(key) if key.isdigit() else -1
        if not 0 <= index < len(buckets):
            raise CheckpointError(path, f"holds weights for bucket {key!r}, but this model's host store has buckets "
                                        f"0-{len(buckets) - 1}: it was written for another model or settings")
        compute = buckets[index].compute
        if tensor.shape != compute.shape or not tensor.is_floating_point():
            raise CheckpointError(path, f"holds bucket {index} as {tuple(tensor.shape)} {tensor.dtype}, but this "
                                        f"model's is {tuple(compute.shape)} {compute.dtype}: it was written for "
                                        f"another model or settings")


def _few(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
