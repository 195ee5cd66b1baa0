"""Refusing the optimizer steps that would not train what they hold: a torch optimizer over a RoundPipe model's
parameters that the engine does not step, a wrapped optimizer whose groups changed after the hand-over, one that a
later optimizer replaced, a step with gradients the engine never sees.

[Note: optimizers the engine does not step]
An engine trains its trainable parameters through its optimizer copies (`engine.parameters()`): the backward
accumulates the gradients there, and the optimizer the engine was given (`wrap_optimizer`, or
`accelerator.prepare(model, optimizer)`, which calls it) steps them on the optimizer thread, bucket by bucket, then
the workers read the new weights. Any other torch optimizer over the same model steps nothing, or the wrong thing:
- over the compute copies, the parameters the wrapped module shows (`model.parameters()` of a Hugging Face model
  after `prepare`, or before it: they are the same objects): they never get a `.grad`, so every step skips every
  parameter and the loss never moves, silently (4.8771 five times in a row where plain accelerate went to 3.88);
- over the optimizer copies (a plain optimizer over `RoundPipe(...).parameters()`, or the user's own optimizer
  object after the engine took it over, stepped instead of what `prepare` returned): it steps them on the caller's
  thread, outside the engine's per-layer order, and under the exact step the workers keep reading the compute
  copies it never writes.
So each is refused at its first `step()`, with the call that hands the optimizer to the engine: torch calls every
global optimizer step pre-hook before any optimizer's step (`register_optimizer_step_pre_hook`, public API), and
the first engine registers one that looks for the tensors of the engines alive (`watch`). The engine's own steppers
(copies of the user's optimizer, [Note: one owner of the step's groups]) step inside `engine_steps()`, which the hook
lets through before looking at anything. Frozen parameters are not looked for: no optimizer, plain or not, changes
them (they get no gradient).
The optimizer the engine steps refuses two more ways of training less than the user's optimizer says, at its
`step()`: groups changed after the hand-over (`add_param_group`, `load_state_dict` or an edited `group["params"]` on
the user's object, whose `param_groups` it shares), which its per-bucket steppers, built from the groups it was
given, would never step (`GROUPS_CHANGED`); and a second optimizer for the same engine (two optimizers given to
`prepare`), which replaces the first: the first's steps would queue on a stopped thread, and the next pass wait for
them for ever (`REPLACED`). The engine steps one optimizer; settings per parameter set are param groups of it.
It also refuses a step after the compute copies got a gradient (`GRADIENT_OUTSIDE`): a loss term computed from the
model's parameters outside its forward (a penalty on the weights) back-propagates into them, not into the pipeline,
and its gradient would be dropped where plain accelerate steps it.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

ENGINE_API = ("Hand it to the engine and step what that returns: `optimizer = engine.wrap_optimizer(optimizer)` (one "
              "optimizer per engine: put parameters that need other settings in param groups of it).")

GROUPS_CHANGED = (
    "the optimizer's parameter groups changed after RoundPipe took it over (`add_param_group`, `load_state_dict` or "
    "an edited `group['params']` on the optimizer object you built, after `accelerator.prepare` / `wrap_optimizer`): "
    "the engine steps the groups it was given, so the change would be ignored and added parameters never train. Add "
    "every group before handing the optimizer over, and load its state through the optimizer that call returned "
    "(or `accelerator.load_state`).")
REPLACED = (
    "this optimizer no longer steps: a later optimizer was handed to the same RoundPipe model (a second optimizer "
    "in `accelerator.prepare`, or `wrap_optimizer` again) and replaced it; the engine steps one optimizer per model. "
    "Train with one optimizer, putting parameters that need other settings in param groups of it "
    "(`torch.optim.AdamW([{'params': body}, {'params': head, 'lr': 1e-4}])`), and step only that one.")
GRADIENT_OUTSIDE = (
    "{count} parameter(s) of the RoundPipe model as it shows them (first: `{name}`) got a gradient outside the "
    "engine: a loss term computed from `model.parameters()` outside the model's forward (a penalty on the weights?) "
    "back-propagated into them. RoundPipe steps the gradients its pipeline computed, on its own optimizer copies, so "
    "this one would be dropped. Drop the term, or express it through the optimizer (`weight_decay` for an L2 "
    "penalty).")

_lock = threading.Lock()
_hints: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> how to hand it an optimizer
_hook: torch.utils.hooks.RemovableHandle | None = None
_stepping = threading.local()  # .active: this thread is stepping an engine's own steppers


def watch(engine, how_to_fix: str = ENGINE_API) -> None:
    """Refuse the step of any optimizer over `engine`'s trainable parameters other than the engine's own, saying
    `how_to_fix`; called again, only the sentence changes (an integration names its own call)."""
    global _hook
    with _lock:
        _hints[engine] = how_to_fix
        if _hook is None:
            _hook = register_optimizer_step_pre_hook(_refuse_foreign_step)


def groups_of(*group_lists: list[dict]) -> tuple:
    """What a wrapped optimizer's steppers were built for: the group lists, their groups and each group's
    parameters, by identity (an edit anywhere shows)."""
    return tuple((id(groups), tuple((id(g), id(g["params"]), tuple(map(id, g["params"]))) for g in groups))
                 for groups in group_lists)


def check_in_charge(optimizer, step: bool = False) -> None:
    """Refuse a call of a wrapped optimizer (`RoundPipeOptimizer`) that a later one replaced; with `step`, a step
    after its groups changed or with gradients on the compute copies."""
    if optimizer.replaced:
        raise RuntimeError(REPLACED)
    if not step:
        return
    if groups_of(optimizer.param_groups, optimizer.inner.param_groups) != optimizer.stepped_groups:
        raise RuntimeError(GROUPS_CHANGED)
    outside = [s.name for b in optimizer.store.trainable_buckets for s in b.slots if s.param.grad is not None]
    if outside:
        raise RuntimeError(GRADIENT_OUTSIDE.format(count=len(outside), name=outside[0]))


@contextlib.contextmanager
def engine_steps() -> Iterator[None]:
    """The optimizer steps inside are an engine's own (on its optimizer thread)."""
    _stepping.active = True
    try:
        yield
    finally:
        _stepping.active = False


def _refuse_foreign_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    if getattr(_stepping, "active", False) or not _hints:
        return
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    with _lock:
        engines = list(_hints.items())
    for engine, how_to_fix in engines:
        if engine.closed:
            continue
        problem = _problem(engine, optimizer, held, how_to_fix)
        if problem is not None:
            raise RuntimeError(problem)


def _problem(engine, optimizer: torch.optim.Optimizer, held: set[int], how_to_fix: str) -> str | None:
    """Why `optimizer` (holding the tensors of ids `held`) must not step `engine`'s parameters, else None."""
    compute, copies = [], []
    for bucket in engine.host_store.trainable_buckets:
        for slot in bucket.slots:
            if id(slot.param) in held:
                compute.append(slot.name)
            if slot.optim is not None and id(slot.optim) in held:
                copies.append(slot.name)
    name = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    if compute:
        return (f"{name}.step() would change nothing: the optimizer holds {len(compute)} trainable parameter(s) of a "
                f"RoundPipe model as the model shows them (first: `{compute[0]}`), which never get a gradient; "
                f"RoundPipe accumulates the gradients on its own optimizer copies and steps those with the optimizer "
                f"it was given, and this one it was not, so the model would not train. {how_to_fix}")
    if not copies:
        return None
    wrapped = engine.optimizer
    if wrapped is not None and wrapped.inner is optimizer:
        return (f"{name}.step() on the optimizer RoundPipe took over: the engine steps it on its optimizer thread "
                f"through the optimizer that `accelerator.prepare` / `wrap_optimizer` returned; stepping this one "
                f"would step {len(copies)} optimizer copies (first: `{copies[0]}`) outside the engine's order. Step "
                f"the returned optimizer instead (`model, optimizer = accelerator.prepare(model, optimizer)` keeps "
                f"it under the same name).")
    return (f"{name}.step() on an optimizer the RoundPipe engine was not given: it holds {len(copies)} of the "
            f"engine's optimizer copies (first: `{copies[0]}`), and stepping them here, outside the engine, races its "
            f"optimizer thread and never reaches the weights the workers compute with. {how_to_fix}")
