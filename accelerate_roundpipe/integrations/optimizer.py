"""Moving a user's optimizer onto RoundPipe's optimizer copies, and accelerate's wrapper around the result.

[Note: optimizer re-pointing]
Users (and `Trainer.create_optimizer`) build their optimizer over `model.parameters()`. Under RoundPipe those
parameters are the *compute* copies (views of the host store the devices read); the copies the optimizer must step
are the engine's fp32 *optimizer* copies, which carry the gradients. Rather than rebuilding the optimizer (its
constructor may need arguments we do not know, and an LR scheduler may already hold it), the user's optimizer object
is kept and each `param_group["params"]` list is re-pointed in place, by parameter identity, to the matching
optimizer copies (accelerate does the same on TPUs, `AcceleratedOptimizer._switch_parameters`). Class, group order,
group hyper-parameters, `defaults`, any existing state and any scheduler built on it are kept. Frozen parameters have
no optimizer copy and are dropped from their group (they never get a gradient); a group may become empty, so
per-group scheduler lambdas keep their positions. The re-pointed optimizer is then wrapped by
`engine.wrap_optimizer` (stepped on the optimizer thread, exactly by default), which steps copies of it that it owns
([Note: one owner of the step's groups]): from then on the user's optimizer object holds the groups (its
hyper-parameters, read at each `step()`) and the wrapper the state.
"""

from __future__ import annotations

import torch
from accelerate.optimizer import AcceleratedOptimizer
from torch import nn

from ..compat.accelerate_internals import check_accelerated_optimizer_init
from ..runtime import RoundPipe, RoundPipeOptimizer


def optimizer_copy_map(engine: RoundPipe) -> dict[int, nn.Parameter]:
    """id(parameter as the user sees it) -> the tensor the optimizer must hold for it.

    Covers the compute copies (`engine.module`'s parameters) and the optimizer copies themselves; frozen parameters
    map to themselves (they have no optimizer copy).
    """
    mapping = {}
    for user_param, optim_param in engine.parameter_copies():
        mapping[id(user_param)] = optim_param
        mapping[id(optim_param)] = optim_param
    return mapping


PREPARE_TOGETHER = ("Build the optimizer over `model.parameters()` and prepare both together: "
                    "`model, optimizer = accelerator.prepare(model, optimizer)`.")

# How an optimizer over a prepared model that was never prepared itself is told to be handed over
# ([Note: optimizers the engine does not step]); plain accelerate allows either call.
PREPARE_THE_OPTIMIZER = (
    "Pass it to `accelerator.prepare` with the model (`model, optimizer = accelerator.prepare(model, optimizer)`) "
    "or after it (`optimizer = accelerator.prepare(optimizer)`), and step the optimizer that returns; with the "
    "Trainer, as `optimizers=(optimizer, scheduler)`. RoundPipe steps one optimizer per model: put parameters that "
    "need other settings in param groups of it.")


def repoint_optimizer(optimizer: torch.optim.Optimizer, engines: list[RoundPipe],
                      how_to_fix: str = PREPARE_TOGETHER) -> RoundPipeOptimizer:
    """Re-point `optimizer` to the optimizer copies of one of `engines` and wrap it. `how_to_fix` ends the
    error for an optimizer over other tensors (the Trainer says what to pass as `optimizers=`).

    See [Note: optimizer re-pointing].
    """
    if isinstance(optimizer, RoundPipeOptimizer):
        return optimizer
    params = [p for group in optimizer.param_groups for p in group["params"]]
    maps = {id(e): optimizer_copy_map(e) for e in engines}
    owners = [e for e in engines if any(id(p) in maps[id(e)] for p in params)]
    if not owners and not engines:
        raise ValueError("the optimizer was prepared before any model: RoundPipe re-points it to the optimizer copies "
                         "of the model it steps, which must exist by then. Prepare the model first or in the same "
                         "call: `model, optimizer = accelerator.prepare(model, optimizer)`.")
    if not owners:
        raise ValueError(f"the optimizer holds no parameter of a RoundPipe model prepared by this accelerator. "
                         f"{how_to_fix}")
    if len(owners) > 1:
        raise ValueError("one optimizer spans the parameters of several RoundPipe models; give each model its own "
                         "optimizer (each engine steps its optimizer on its own thread).")
    engine = owners[0]
    mapping = maps[id(engine)]
    foreign = [p for p in params if id(p) not in mapping]
    if foreign:
        raise ValueError(f"the optimizer holds {len(foreign)} tensor(s) that are not parameters of the RoundPipe "
                         f"model it steps (first shape: {tuple(foreign[0].shape)}); build the optimizer over that "
                         f"model's parameters only. {how_to_fix}")
    new_of_old: dict[int, nn.Parameter] = {}
    for group in optimizer.param_groups:
        kept, kept_ids = [], set()
        for p in group["params"]:
            target = mapping[id(p)]
            new_of_old[id(p)] = target
            if target.requires_grad and id(target) not in kept_ids:
                kept.append(target)
                kept_ids.add(id(target))
        group["params"] = kept
    _rekey_state(optimizer, new_of_old)
    return engine.wrap_optimizer(optimizer)


def _rekey_state(optimizer: torch.optim.Optimizer, new_of_old: dict[int, nn.Parameter]) -> None:
    """Per-parameter state (e.g. an optimizer loaded before `prepare`) follows its parameter."""
    if not optimizer.state:
        return
    moved = {}
    for param, state in optimizer.state.items():
        target = new_of_old.get(id(param), param)
        moved[target] = state
    optimizer.state.clear()
    optimizer.state.update(moved)


class RoundPipeAcceleratedOptimizer(AcceleratedOptimizer):
    """accelerate's optimizer wrapper (gradient-accumulation aware `step`/`zero_grad`) around a `RoundPipeOptimizer`.

    Device placement and loss scaling are off: the optimizer state stays on the host, next to the optimizer copies.
    """

    def __init__(self, optimizer: RoundPipeOptimizer) -> None:
        check_accelerated_optimizer_init()  # [Note: compatibility reaches]
        super().__init__(optimizer, device_placement=False, scaler=None)

