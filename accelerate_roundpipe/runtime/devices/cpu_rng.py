"""A CPU worker's RNG stream, drawn from without touching the process-wide generator.

[Note: CPU worker RNG]
Each layer run draws from its own stream (seeded by `stream_seed`: the recomputation replays the forward's
masks). torch has no per-thread default generator, but dispatch modes are per thread: `StreamRandom` makes every
random op run on the worker's thread draw from the stream's own `torch.Generator`, and no op run under it ever
reads or advances the process-wide generator, which the user's threads draw from at the same time (an earlier
version swapped the stream's state into the process-wide generator for the ops without a `generator` argument;
a user thread drawing meanwhile shifted the worker's masks: 27 of 480 recomputed `rand_like` masks differed from
the forward's, so gradients were wrong without an error). How each op is handled is decided once per op
(`_plan`), from torch's own registry:
- an op with a `generator` argument (`bernoulli_` of dropout, `uniform_`, `normal_`, `multinomial`, `rrelu`, ...)
  gets the stream's generator when none is given;
- an op tagged `nondeterministic_seeded` without one is rewritten into its twin overload that takes one
  (`rand` -> `rand.generator`, `randint.low` -> `randint.low_generator`, `randn_like` -> `randn_like.generator`, ...:
  the same arguments plus `generator`, so the same values as torch's op for the same generator state); without
  such a twin (torch < 2.7 has none for the `*_like` ops) `rand_like`/`randn_like`/`randint_like` become
  `empty_like(...).uniform_/normal_/random_(generator=)`, which is how ATen implements them, and `native_dropout`
  becomes ATen's CPU kernel with the generator passed (`_native_dropout`);
- the dropout ops, seen whole under `torch.inference_mode` (the engine never enters it; a layer might), are
  decomposed with the mode active, so their inner draws are handled as above;
- ops tagged so without drawing (`_fused_sdp_choice` picks a kernel) and attention/RNN ops called with a zero
  dropout probability (or not training) run as they are;
- anything else (a fused attention or cuDNN kernel with dropout on, an `lstm` with dropout seen whole) raises,
  naming the op: it would draw from the process-wide generator, and no recomputation could replay it.
`tests/test_dropout_streams.py` walks torch's registry so a new random op cannot slip through unhandled.
"""

from __future__ import annotations

import enum
import functools

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Tagged `nondeterministic_seeded` in torch's registry, yet they draw nothing.
_DRAWS_NOTHING = frozenset({
    "aten::_fused_sdp_choice",  # picks an attention kernel
    "aten::_nested_tensor_softmax_with_shape",  # a softmax
})
# Composite ops the mode sees whole only under `torch.inference_mode`; their decomposition draws through `bernoulli_`
# or `native_dropout`, as their ordinary call does. (`lstm` is not among them: its decomposition skips the dropout
# its ordinary call applies, so with dropout on it is refused.)
_DECOMPOSED = frozenset({"dropout", "dropout_", "alpha_dropout", "alpha_dropout_", "feature_dropout",
                         "feature_dropout_", "feature_alpha_dropout", "feature_alpha_dropout_"})
_PROBABILITY_ARGUMENTS = ("dropout_p", "dropout", "p")
_TRAINING_ARGUMENTS = ("train", "training")


class _Kind(enum.Enum):
    PASS = "runs as it is"
    FILL = "given the stream's generator"
    TWIN = "rewritten to its overload that takes a generator"
    LIKE = "rewritten to empty_like(...) filled from the generator"
    NATIVE_DROPOUT = "rewritten to ATen's CPU dropout with the generator"
    DECOMPOSE = "decomposed under the mode"
    UNLESS_DROPOUT = "runs as it is with no dropout, refused with dropout"
    REFUSE = "refused"


@functools.cache
def _plan(func) -> tuple[_Kind, object]:
    """How `StreamRandom` runs `func` ([Note: CPU worker RNG]), with what that needs (a position, an overload)."""
    arguments = func._schema.arguments
    names = [a.name for a in arguments]
    if "generator" in names:
        return _Kind.FILL, names.index("generator")
    operator = func._schema.name  # "aten::rand" of "aten::rand.out"
    if torch.Tag.nondeterministic_seeded not in func.tags or operator in _DRAWS_NOTHING:
        return _Kind.PASS, None
    twin = _generator_twin(func)
    if twin is not None:
        return _Kind.TWIN, twin
    base = operator.split("::")[1]
    if base in _LIKE_FILLS and func._overloadname in ("default", "low_dtype", "Tensor"):
        return _Kind.LIKE, base
    if operator == "aten::native_dropout" and func._overloadname == "default":
        return _Kind.NATIVE_DROPOUT, None
    if base in _DECOMPOSED:
        return _Kind.DECOMPOSE, None
    probability = [i for i, n in enumerate(names) if n in _PROBABILITY_ARGUMENTS]
    if probability:
        training = [i for i, n in enumerate(names) if n in _TRAINING_ARGUMENTS]
        return _Kind.UNLESS_DROPOUT, (probability[0], training[0] if training else None)
    return _Kind.REFUSE, None


def _generator_twin(func):
    """The overload of `func`'s operator with the same arguments plus a keyword-only `generator`, or None."""
    packet = getattr(torch.ops.aten, func._schema.name.split("::")[1])
    wanted = [(a.name, a.kwarg_only) for a in func._schema.arguments]
    for overload in packet.overloads():
        candidate = getattr(packet, overload)
        arguments = candidate._schema.arguments
        if [(a.name, a.kwarg_only) for a in arguments if a.name != "generator"] == wanted and \
                any(a.name == "generator" and a.kwarg_only for a in arguments):
            return candidate
    return None


def _argument(func, args: tuple, kwargs: dict, position: int):
    argument = func._schema.arguments[position]
    if position < len(args):
        return args[position]
    return kwargs.get(argument.name, argument.default_value if argument.has_default_value() else None)


def _like(base: str, generator: torch.Generator, self: torch.Tensor, *bounds, dtype=None, layout=None, device=None,
          pin_memory=None, memory_format=None) -> torch.Tensor:
    """ATen's `rand_like` / `randn_like` / `randint_like` (`empty_like` filled in place), drawing from `generator`."""
    out = torch.empty_like(self, dtype=dtype, layout=layout, device=device, pin_memory=bool(pin_memory),
                           memory_format=memory_format if memory_format is not None else torch.preserve_format)
    return _LIKE_FILLS[base](out, bounds, generator)


def _random_bounds(bounds: tuple) -> tuple:
    bounds = tuple(int(b.item()) if isinstance(b, torch.Tensor) else b for b in bounds)
    return bounds if len(bounds) == 2 else (0,) + bounds


_LIKE_FILLS = {
    "rand_like": lambda out, bounds, g: out.uniform_(0, 1, generator=g),
    "randn_like": lambda out, bounds, g: out.normal_(0, 1, generator=g),
    "randint_like": lambda out, bounds, g: out.random_(*_random_bounds(bounds), generator=g),
}


def _native_dropout(generator: torch.Generator, input: torch.Tensor, p: float, train: bool | None):
    """ATen's CPU `native_dropout`, drawing its mask from `generator`."""
    if input.numel() == 0:
        return input, torch.empty_like(input)
    if train is None or train:
        keep = 1.0 - p
        scale = 0.0 if keep == 0 else 1.0 / keep
        mask = torch.empty_like(input, memory_format=torch.contiguous_format).bernoulli_(keep, generator=generator)
        return input.mul(mask).mul_(scale), mask.to(torch.bool)
    return input.clone(), torch.ones_like(input, dtype=torch.bool)


class StreamRandom(TorchDispatchMode):
    """Inside it, random ops on this thread draw from `generator` ([Note: CPU worker RNG])."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(seed)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind, detail = _plan(func)
        if kind is _Kind.PASS:
            return func(*args, **kwargs)
        if kind is _Kind.FILL:
            if detail < len(args):
                if args[detail] is None:
                    args = args[:detail] + (self.generator,) + args[detail + 1:]
            elif kwargs.get("generator") is None:
                kwargs = {**kwargs, "generator": self.generator}
            return func(*args, **kwargs)
        if kind is _Kind.TWIN:
            return detail(*args, **kwargs, generator=self.generator)
        if kind is _Kind.LIKE:
            return _like(detail, self.generator, *args, **kwargs)
        if kind is _Kind.NATIVE_DROPOUT:
            return _native_dropout(self.generator, *args, **kwargs)
        if kind is _Kind.DECOMPOSE:
            with self:  # the mode is off inside its own handler: the decomposition's draws must come here too
                return func.decompose(*args, **kwargs)
        if kind is _Kind.UNLESS_DROPOUT:
            probability, training = detail
            if not _argument(func, args, kwargs, probability) or \
                    (training is not None and _argument(func, args, kwargs, training) is False):  # None: training
                return func(*args, **kwargs)
        raise RuntimeError(
            f"{func._schema.name} draws random numbers from the process-wide generator and takes no generator, so "
            f"a CPU worker cannot draw it from the layer's own stream, and the backward's recomputation could not "
            f"replay it ([Note: CPU worker RNG] in accelerate_roundpipe/runtime/cpu_rng.py). Use an op that takes a "
            f"generator in that layer (torch.nn.functional.dropout, torch.rand, torch.bernoulli do), turn that "
            f"dropout off, or run on CUDA devices (RoundPipeConfig(devices=...)).")
