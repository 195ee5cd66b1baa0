"""Turning a user's model into a RoundPipe model, and finding the engine behind a model later.

`convert_model` returns the object the user keeps calling: for a Hugging Face causal LM (plain or PEFT) that is the
user's own model object, whose `forward`/`generate`/`save_pretrained` the engine patched (`wrap_model`); for an
`nn.Sequential` it is the `RoundPipe` engine itself. Either way the weights stay in host memory: nothing here moves
a model to a GPU.

The registry maps both the returned object and the engine to the engine, weakly, so integrations can look up "the
engine of this model" without adding attributes to the user's module (an `nn.Module` attribute would register the
engine as a submodule and show up in `state_dict()`).
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch import nn

from ..compat.hf_models import check_zero_grad_replacement, patch_methods
from ..config import RoundPipeConfig
from ..models import CausalLMRoundPipe, UnsupportedModelError, wrap_model
from ..runtime import RoundPipe

# Weak both ways: a model keeps its engine alive through its patched methods, not through this table.
_engines: weakref.WeakKeyDictionary[nn.Module, weakref.ref] = weakref.WeakKeyDictionary()

# One sentence with its full stop: `UnsupportedModelError` appends the next one after a space.
HOW_TO_TURN_OFF = ("To train this model without RoundPipe, run the script without the RoundPipe launcher "
                   "(`python script.py` / plain `accelerate launch`) or use the stock Accelerator or Trainer.")


def engine_of(model: object) -> RoundPipe | None:
    """The engine behind `model` (a converted model, or an engine itself), else None."""
    if isinstance(model, RoundPipe):
        return model
    try:
        ref = _engines.get(model)
    except TypeError:  # not weak-referenceable: certainly not ours
        return None
    return None if ref is None else ref()


def user_facing(engine: RoundPipe) -> nn.Module:
    """What `prepare` hands back for `engine`: the patched HF model, or the engine for an `nn.Sequential`."""
    return engine.module if isinstance(engine, CausalLMRoundPipe) else engine


def convert_model(model: nn.Module, config: RoundPipeConfig) -> tuple[nn.Module, RoundPipe]:
    """Put `model` on RoundPipe (once); returns `(model_to_use, engine)`."""
    engine = engine_of(model)
    if engine is not None:
        return user_facing(engine), engine
    if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        raise ValueError(f"the model is wrapped in {type(model).__name__}, but RoundPipe drives every GPU of a "
                         f"machine from one process and reduces gradients across machines itself. Pass the bare "
                         f"model (`model.module`) and list the GPUs in `devices` (env ROUNDPIPE_DEVICES, e.g. "
                         f"'cuda:0,cuda:1').")
    # Stock loops keep the last, shorter batch of an epoch: [Note: short batches] in runtime/execution/microbatches.py.
    if isinstance(model, nn.Sequential):
        engine = RoundPipe(model, config, allow_short_batches=True)
    else:
        try:
            engine = wrap_model(model, config, allow_short_batches=True)
        except UnsupportedModelError as error:
            raise UnsupportedModelError(model, f"{error.problem}. {HOW_TO_TURN_OFF}") from error
        _patch_zero_grad(engine.module, engine)
    returned = user_facing(engine)
    for key in (model, returned, engine):
        _engines[key] = weakref.ref(engine)
    return returned, engine


def _patch_zero_grad(module: nn.Module, engine: RoundPipe) -> None:
    """`model.zero_grad()` clears the engine's gradients (the module's own parameters never hold any).

    `transformers.Trainer` and many loops clear gradients through the model, not the optimizer; the gradients live
    on the optimizer copies, so the call is routed to the lagged optimizer, which clears them in order with the
    pending steps. Without an optimizer the engine is synchronized and the gradients are zeroed in place.
    The patch is one of the [Note: compatibility reaches].
    """
    check_zero_grad_replacement()
    patch_methods(module, {"zero_grad": functools.partial(_zero_engine_grads, weakref.ref(engine))})


def _zero_engine_grads(engine_ref: weakref.ref, set_to_none: bool = True) -> None:
    engine = engine_ref()
    if engine is None:
        return
    if engine.optimizer is not None:
        engine.optimizer.zero_grad(set_to_none=set_to_none)
        return
    engine.synchronize()
    with torch.no_grad():
        for p in engine.parameters():
            if p.grad is not None:
                p.grad.zero_()
