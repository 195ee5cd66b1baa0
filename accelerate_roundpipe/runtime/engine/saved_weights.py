"""The weights a saved model holds: the newest values, in the dtype the model had before RoundPipe took it over.

[Note: saved model dtype]
With compute copies narrower than the model (`param_dtype=bfloat16`, which `bf16=True` and `mixed_precision="bf16"`
set) the user's module shows the bfloat16 compute copies, but the model being trained is the float32 one, held in the
optimizer copies: the plain Trainer with `bf16=True` keeps a float32 model under autocast and saves float32. So what
is saved as *the model* (the patched `save_pretrained`, hence the Trainer's `save_model` and its checkpoints'
weights; `accelerator.get_state_dict`, hence accelerate's `save_state`) is every parameter in its own dtype
(`ParamSlot.model_dtype`), cast from its optimizer copy; `config.json` says that dtype. A frozen parameter has no
optimizer copy: it was rounded to the compute dtype when the engine was built, and is saved as those values cast
back. Where the compute copy already is the model's dtype it is saved as it is (it equals the optimizer copy rounded
to that dtype) and nothing is copied. The module itself keeps showing the compute copies (`model.dtype` is
bfloat16 after training): they are what the devices compute with.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from ..state.host_store import ParamSlot
from .engine import RoundPipe


def _slot(engine: RoundPipe, param: torch.nn.Parameter) -> ParamSlot | None:
    store = engine.host_store
    where = store.bucket_of.get(id(param))
    return None if where is None else store.buckets[where[0]].slots[where[1]]


def _optimizer_copy(engine: RoundPipe, param: torch.nn.Parameter, slot: ParamSlot) -> torch.Tensor:
    """`slot`'s optimizer copy values, read where its bucket's tier keeps them ([Note: disk tier])."""
    bucket = engine.host_store.buckets[engine.host_store.bucket_of[id(param)][0]]
    return bucket.tier.optim_values(bucket)[slot.offset:slot.offset + slot.numel].view(slot.shape)


def model_dtype_parameters(engine: RoundPipe) -> dict[str, torch.Tensor]:
    """The parameters (by state-dict name) whose compute copy is not in the model's own dtype, as new tensors in
    that dtype from their optimizer copies; tied names share one tensor. Call after `engine.synchronize()`."""
    made: dict[int, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for name, param in engine.module.named_parameters(remove_duplicate=False):
        slot = _slot(engine, param)
        if slot is None or slot.model_dtype is None or param.dtype == slot.model_dtype:
            continue
        if id(param) not in made:
            source = _optimizer_copy(engine, param, slot) if slot.optim is not None else param
            # on the host, where the module's parameters are (an optimizer copy may be on its device)
            source = source.detach()
            made[id(param)] = (source.to(slot.model_dtype, copy=True) if source.device == param.device
                               else source.to(slot.model_dtype).to(param.device))  # cast on the device, then copy
        out[name] = made[id(param)]
    return out


def model_dtype_state_dict(engine: RoundPipe) -> OrderedDict[str, torch.Tensor]:
    """The module's state dict (newest weights; synchronizes) with every parameter in the model's own dtype
    ([Note: saved model dtype]). Parameters already in it stay views of the host store."""
    state = engine.state_dict()
    state.update(model_dtype_parameters(engine))  # same keys: the order (and accelerate's tie handling) is kept
    return state


def model_dtype(engine: RoundPipe) -> torch.dtype | None:
    """What `model.dtype` said before RoundPipe took the model over (its first floating-point parameter's dtype, as
    Hugging Face's `ModuleUtilsMixin.dtype`)."""
    for param in engine.module.parameters():
        if param.is_floating_point():
            slot = _slot(engine, param)
            return slot.model_dtype if slot is not None and slot.model_dtype is not None else param.dtype
    return None
