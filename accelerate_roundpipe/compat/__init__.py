"""Every reach into the internals of transformers, accelerate, TRL, PEFT and torch, in one place, each checked.

[Note: compatibility reaches]
RoundPipe sits under libraries it does not own: it overrides private methods of `transformers.Trainer`, swaps names
in their modules for one call, reads private lists of `accelerate.Accelerator`, patches methods of the user's model
object, reads the closure of TRL's fused LM head. A library upgrade that renames or reshapes any of these would not
raise: an override of a renamed method is never called, a swapped name nobody looks up any more changes nothing, a
closure without the cell reads as "not patched". So each reach is a small named function here, whose docstring says
what it reaches, why, and the versions it was written against (`WRITTEN_AGAINST`), and which checks its assumption
(the attribute exists, the method still looks the name up, the signature still has the parameters we pass, the
overridden method is still on the base class) before relying on it. When the assumption fails it raises
`LibraryChangedError`, naming the library, its installed version, the reach and what to do (pin the version the
reach was written against, or report it), instead of silently doing nothing. `tests/integrations/test_compat.py`
runs every check against the installed versions and against a faked change.

The reaches, by library: `hf_trainer.py` (transformers' Trainer and TrainingArguments), `hf_models.py` (the user's
model: its patched methods, PEFT and transformers' `save_pretrained`), `accelerate_internals.py` (accelerate's
Accelerator and state), `trl_internals.py` (TRL's trainers and fused LM head), `torch_internals.py` (torch's
process group and LR scheduler), `launcher_swaps.py` (the classes `launch/install.py` swaps under stock scripts),
`peft_internals.py` (PEFT's LoRA wrapper of bare parameters, such as MoE experts', run on the engine's layer copies),
`peft_linear.py` (PEFT's LoRA on linear layers, its product added inside one GEMM on the layer copies),
`hf_experts.py` (transformers' experts implementations, chosen on each layer copy).
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import types
from collections.abc import Callable, Mapping

# The versions every reach was written against (the ones installed when it was written; the GPU machine ran torch
# 2.11 with the same code).
WRITTEN_AGAINST = {"torch": "2.13 (2.11 on GPU)", "transformers": "5.24", "accelerate": "1.15", "peft": "0.21",
                   "trl": "1.16"}


class LibraryChangedError(RuntimeError):
    """A library RoundPipe reaches into changed the internal it relies on ([Note: compatibility reaches])."""

    def __init__(self, library: str, reach: str, problem: str) -> None:
        self.library, self.reach, self.problem = library, reach, problem
        written = WRITTEN_AGAINST.get(library, "?")
        pin = written.split(" ")[0]
        super().__init__(
            f"accelerate_roundpipe cannot run on the installed {library} {installed_version(library)}: {reach}, "
            f"which RoundPipe relies on, changed ({problem}). This reach was written against {library} {written}. "
            f"Install that version (`pip install '{library}=={pin}.*'`), or report this message to "
            f"accelerate_roundpipe's maintainers so the reach in accelerate_roundpipe/compat/ follows "
            f"the new {library}.")


def installed_version(library: str) -> str:
    try:
        return importlib.metadata.version(library)
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


# [Note: compat checks run once]
# Some checks guard a reach made on every training step (the Trainer's gradient-accumulation scale and
# num_processes factor, the scheduler's step flag, accelerate's backend, the nested_gather swap, TRL's fused head's
# temperature), and reading a library function's code costs 10-250 us. That code cannot change under a running
# process but by replacing the function (a new version is a new process), so each reading of it (`mentions`,
# `closures_over`) is remembered per function object: a step's check is then a dictionary look-up. A function
# replaced (a monkeypatched fake, a subclass's own method) is a new key, read afresh. Nothing is remembered of a
# check that fails: its `LibraryChangedError` is raised by the caller on every call, from the first.


def _code(function: Callable) -> types.CodeType | None:
    """The code of `function`, unwrapped from decorators: where every reading of a library's code starts."""
    return getattr(inspect.unwrap(function), "__code__", None)


def _code_objects(function: Callable) -> list[types.CodeType]:
    """The code of `function` (unwrapped from decorators) and of every function nested in it."""
    code = _code(function)
    found, stack = [], [code] if code is not None else []
    while stack:
        code = stack.pop()
        found.append(code)
        stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return found


def _once_per_function(read: Callable) -> Callable:
    """`read(function, name)`, remembered per (function, name) ([Note: compat checks run once]); read each time for
    a callable that cannot be a dictionary key."""
    remembered = functools.lru_cache(maxsize=None)(read)

    @functools.wraps(read)
    def once(function: Callable, name: str):
        try:
            hash(function)
        except TypeError:
            return read(function, name)
        return remembered(function, name)

    return once


@_once_per_function
def mentions(function: Callable, name: str) -> bool:
    """Whether `function`'s code looks up `name`: as a global or an attribute (`co_names`), or as a string
    constant (`getattr(obj, "name", ...)`)."""
    return any(name in code.co_names or name in code.co_consts for code in _code_objects(function))


@_once_per_function
def closures_over(function: Callable, name: str) -> tuple[types.CodeType, ...]:
    """The code of the functions defined directly in `function` that close over its local `name`."""
    code = _code(function)
    return tuple(c for c in (code.co_consts if code is not None else ())
                 if isinstance(c, types.CodeType) and name in c.co_freevars)


def require_attribute(owner: object, name: str, library: str, reach: str) -> object:
    """`getattr(owner, name)`, or `LibraryChangedError` when it is gone."""
    try:
        return getattr(owner, name)
    except AttributeError:
        owner_name = getattr(owner, "__name__", type(owner).__name__)
        raise LibraryChangedError(library, reach, f"{owner_name} has no attribute `{name}` any more") from None


def require_mention(function: Callable, name: str, library: str, reach: str) -> None:
    """`function` still looks `name` up (so swapping or setting `name` still reaches it)."""
    if not mentions(function, name):
        raise LibraryChangedError(library, reach, f"{getattr(function, '__qualname__', function)} no longer looks "
                                                  f"up `{name}`")


def require_parameters(function: Callable, names: tuple[str, ...], library: str, reach: str, *,
                       leading: bool = True, or_var_keyword: tuple[str, ...] = ()) -> None:
    """`function` takes the parameters `names` (after `self`): as its first ones in that order when `leading` (we
    pass them positionally, and nothing else: so every parameter after them must have a default), else anywhere. A
    name in `or_var_keyword` may come through `**kwargs` instead."""
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError) as error:
        raise LibraryChangedError(library, reach, f"its signature cannot be read ({error})") from None
    if parameters and parameters[0].name == "self":
        parameters = parameters[1:]
    has_var_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
    named = [p for p in parameters if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    given = [p.name for p in named]
    if leading:
        ok = given[:len(names)] == list(names)
    else:
        ok = all(n in given or (n in or_var_keyword and has_var_keyword) for n in names)
    if not ok:
        raise LibraryChangedError(library, reach, f"{getattr(function, '__qualname__', function)} takes "
                                                  f"({', '.join(given)}), not ({', '.join(names)}) as RoundPipe "
                                                  f"passes them")
    if leading:  # a new parameter without a default would be missing from RoundPipe's call
        required = [p.name for p in named[len(names):] if p.default is inspect.Parameter.empty]
        if required:
            raise LibraryChangedError(library, reach, f"{getattr(function, '__qualname__', function)} now also "
                                                      f"requires ({', '.join(required)}), which RoundPipe does not "
                                                      f"pass")


def check_overrides(cls: type, base: type, overrides: Mapping[str, tuple[str, ...] | None], library: str) -> None:
    """`cls` (RoundPipe's subclass of `base`) overrides exactly `overrides` of `base`'s methods, and each one still
    exists on `base`, taking the parameters listed (first, in that order, and no other without a default: `()` is a
    method RoundPipe calls with none; None: existence only, for one it passes `*args, **kwargs` through). Every other
    attribute `cls` defines must be absent from `base`: a method the library added under one of RoundPipe's own
    names would otherwise be replaced without anyone knowing."""
    for name, parameters in overrides.items():
        reach = f"{base.__module__}.{base.__qualname__}.{name} (overridden by {cls.__qualname__})"
        if not hasattr(base, name):
            raise LibraryChangedError(library, reach, f"{base.__qualname__} has no `{name}` any more, so "
                                                      f"RoundPipe's override would never be called")
        if parameters is not None:  # `()` too: a method that now requires a parameter is checked as any other
            attribute = inspect.getattr_static(base, name)
            function = getattr(attribute, "fget", None) or getattr(base, name)
            require_parameters(function, parameters, library, reach)
    for name in vars(cls):
        if name.startswith("__") or name in overrides:
            continue
        if hasattr(base, name):
            raise LibraryChangedError(
                library, f"{base.__module__}.{base.__qualname__}.{name}",
                f"{base.__qualname__} now has a `{name}` of its own, which {cls.__qualname__}.{name} would replace")
