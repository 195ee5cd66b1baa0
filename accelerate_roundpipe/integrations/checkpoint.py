"""Saving and loading RoundPipe models inside accelerate/Trainer checkpoints.

Three things differ from a plain model:

- The module's tensors are views of one flat host buffer per layer. accelerate's safetensors writer takes tensors
  sharing a storage for tied weights and drops all but one, so `detached_state_dict` hands out copies (tied weights
  stay tied: one copy per distinct view).
- Loading into the module writes only the compute copies; `EngineWeights` routes accelerate's loader through
  `engine.load_state_dict`, which also refreshes the optimizer copies.
- With a low-precision compute copy (e.g. `param_dtype=bfloat16`), the saved model weights are rounded; the fp32
  optimizer copies are saved beside them (`OPTIMIZER_COPIES_FILE`) so a resume continues from the exact values.
- The engine's RNG streams (dropout masks) and dispatch position are saved too (`ENGINE_STATE_FILE`), so a resumed
  run draws the same masks as an uninterrupted one.

Every function synchronizes the engine first: the lagged step is flushed before anything is read or written.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict

import torch

from ..runtime import RoundPipe

OPTIMIZER_COPIES_FILE = "roundpipe_optimizer_copies{suffix}.safetensors"
# The weights the next pass computes with under the lagged step, one step older than the saved model
# ([Note: looking changes nothing]): a resume then follows the uninterrupted run exactly.
LAGGED_WEIGHTS_FILE = "roundpipe_lagged_weights{suffix}.safetensors"
ENGINE_STATE_FILE = "roundpipe_engine_state{suffix}.json"


def detached_state_dict(engine: RoundPipe) -> OrderedDict[str, torch.Tensor]:
    """The module's state dict (newest weights), each distinct tensor copied out of the host store once."""
    state = engine.state_dict()  # synchronizes
    copies: dict[tuple, torch.Tensor] = {}
    out = OrderedDict()  # as `state_dict()` returns: accelerate removes tied duplicates only from an OrderedDict
    for name, tensor in state.items():
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
    with open(os.path.join(directory, ENGINE_STATE_FILE.format(suffix=suffix)), "w") as f:
        json.dump(engine.engine_state(), f)
    lagged = engine.lagged_weights()
    if lagged:
        save_file(lagged, os.path.join(directory, LAGGED_WEIGHTS_FILE.format(suffix=suffix)))
    if not has_low_precision_compute(engine):
        return
    tensors = {name: p.detach().clone() for name, p in engine.named_parameters() if p.requires_grad}
    save_file(tensors, os.path.join(directory, OPTIMIZER_COPIES_FILE.format(suffix=suffix)))


def load_engine_extras(engine: RoundPipe, directory: str, suffix: str = "") -> None:
    """Restore what `save_engine_extras` wrote (each part only if present)."""
    state_path = os.path.join(directory, ENGINE_STATE_FILE.format(suffix=suffix))
    if os.path.isfile(state_path):
        with open(state_path) as f:
            engine.load_engine_state(json.load(f))
    from safetensors.torch import load_file

    path = os.path.join(directory, OPTIMIZER_COPIES_FILE.format(suffix=suffix))
    if os.path.isfile(path):
        engine.load_optimizer_copies(load_file(path))
    path = os.path.join(directory, LAGGED_WEIGHTS_FILE.format(suffix=suffix))
    if os.path.isfile(path):  # last: loading weights forgets what the next pass would have computed with
        engine.load_lagged_weights(load_file(path))


def refresh_optimizer_copies(engine: RoundPipe) -> None:
    """After weights were loaded into the module directly (e.g. `Trainer` resuming, PEFT `load_adapter`), make the
    optimizer copies follow the compute copies."""
    engine.load_state_dict(engine.module.state_dict())
