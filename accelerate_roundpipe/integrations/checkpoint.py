"""Saving and loading RoundPipe models inside accelerate/Trainer checkpoints.

What differs from a plain model:

- The module's tensors are views of one flat host buffer per layer. accelerate's safetensors writer takes tensors
  sharing a storage for tied weights and drops all but one, so `detached_state_dict` hands out copies (tied weights
  stay tied: one copy per distinct view).
- Loading into the module writes only the compute copies; `EngineWeights` routes accelerate's loader through
  `engine.load_state_dict`, which also refreshes the optimizer copies.
- With a low-precision compute copy (e.g. `param_dtype=bfloat16`), the model weights are saved in the model's own
  dtype from the optimizer copies ([Note: saved model dtype]), but loading them goes through the compute copies,
  rounding them; so the fp32 optimizer copies are saved beside them (`OPTIMIZER_COPIES_FILE`) and a resume
  continues from the exact values.
- The engine's RNG streams (dropout masks) and dispatch position are saved too (`ENGINE_STATE_FILE`), so a resumed
  run draws the same masks as an uninterrupted one. Each of these files is checked when read back
  ([Note: checkpoint files]).

Every function synchronizes the engine first: the lagged step is flushed before anything is read or written.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from ..runtime import RoundPipe
from ..runtime.engine.saved_weights import model_dtype_parameters
from .checkpoint_files import (  # noqa: F401 - the file names, imported from here too
    ENGINE_STATE_FILE,
    LAGGED_WEIGHTS_FILE,
    OPTIMIZER_COPIES_FILE,
    file_paths,
    read_engine_extras,
    write_engine_state,
)


def detached_state_dict(engine: RoundPipe) -> OrderedDict[str, torch.Tensor]:
    """The module's state dict (newest weights, in the model's own dtype: [Note: saved model dtype]), each distinct
    tensor copied out of the host store once."""
    state = engine.state_dict()  # synchronizes
    made = model_dtype_parameters(engine)  # new tensors already: not copied again
    copies: dict[tuple, torch.Tensor] = {}
    out = OrderedDict()  # as `state_dict()` returns: accelerate removes tied duplicates only from an OrderedDict
    for name, tensor in state.items():
        if name in made:
            out[name] = made[name]
            continue
        key = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
        if key not in copies:
            copies[key] = tensor.detach().clone()
        out[name] = copies[key]
    return out


class EngineWeights:
    """Stands in for a RoundPipe model in accelerate's `load_state` (see the module docstring)."""

    def __init__(self, engine: RoundPipe) -> None:
        self.engine = engine

    def state_dict(self) -> dict[str, torch.Tensor]:
        return detached_state_dict(self.engine)

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True, **kwargs):
        return self.engine.load_state_dict(state_dict, strict=strict)


def has_low_precision_compute(engine: RoundPipe) -> bool:
    """True when some compute copy is narrower than its optimizer copy (saving only the model would round it)."""
    for (_, compute), (_, optim) in zip(engine.module.named_parameters(), engine.named_parameters()):
        if optim.requires_grad and compute.dtype != optim.dtype:
            return True
    return False


def save_engine_extras(engine: RoundPipe, directory: str, suffix: str = "") -> None:
    """Write what an exact resume needs beyond weights and optimizer state: the engine's RNG/dispatch state, and
    the trainable optimizer copies when the model weights alone would lose precision."""
    from safetensors.torch import save_file

    engine.synchronize()
    state_path, copies_path, lagged_path = file_paths(directory, suffix)
    written = []
    lagged = engine.lagged_weights()
    if lagged:
        save_file(lagged, lagged_path)
        written.append(lagged_path)
    if has_low_precision_compute(engine):
        tensors = engine.optimizer_copies()  # read where they live (the disk tier's from its files)
        save_file(tensors, copies_path)
        written.append(copies_path)
    # Last, listing the others: a save cut short leaves no engine state, and a resume says so
    # ([Note: checkpoint files]).
    write_engine_state(state_path, engine.engine_state(), written)


def load_engine_extras(engine: RoundPipe, directory: str, suffix: str = "") -> None:
    """Restore what `save_engine_extras` wrote (each part only if written). Every file is read and checked first:
    one missing, damaged or of another model raises `CheckpointError` before anything is loaded
    ([Note: checkpoint files])."""
    extras = read_engine_extras(engine, directory, suffix)
    if extras.engine_state is not None:
        engine.load_engine_state(extras.engine_state)
    if extras.optimizer_copies is not None:
        engine.load_optimizer_copies(extras.optimizer_copies)
    if extras.lagged_weights is not None:  # last: loading weights forgets what the next pass would have computed with
        engine.load_lagged_weights(extras.lagged_weights)


def refresh_optimizer_copies(engine: RoundPipe) -> None:
    """After weights were loaded into the module directly (e.g. `Trainer` resuming, PEFT `load_adapter`), make the
    optimizer copies follow the compute copies."""
    engine.load_state_dict(engine.module.state_dict())
