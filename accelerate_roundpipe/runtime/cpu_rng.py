"""A CPU worker's RNG stream, drawn from without touching the process-wide generator.

[Note: CPU worker RNG]
Each layer run draws from its own stream (seeded by `stream_seed`: the recomputation replays the forward's
masks). A CPU worker used to seed the process-wide CPU generator for the layer and restore it afterwards; the
user's thread draws from that same generator, so a seeded draw there while a worker ran came out of the worker's
stream (and the worker's masks then differed from its recomputation's): seen in 1 of 199 batches. torch has no
per-thread default generator, but dispatch modes are per thread: `StreamRandom` gives every random op run on the
worker's thread that takes a `generator` argument (dropout's `bernoulli_`, `multinomial`, `rrelu`, `normal_`, ...)
the stream's own generator. The few random ops without one (`rand`, `randint`, `randperm`, `rand_like`, ...) run
on the process-wide generator with the stream's state swapped in and out under a lock, as before, for that op
alone.
"""

from __future__ import annotations

import functools
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_GLOBAL_SWAP = threading.Lock()


@functools.cache
def _generator_position(func) -> int | None:
    """The index of `func`'s `generator` argument, None when it has none."""
    for index, argument in enumerate(func._schema.arguments):
        if argument.name == "generator":
            return index
    return None


class StreamRandom(TorchDispatchMode):
    """Inside it, random ops on this thread draw from `generator` ([Note: CPU worker RNG])."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(seed)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded not in func.tags:
            return func(*args, **kwargs)
        position = _generator_position(func)
        if position is not None:
            given = args[position] if position < len(args) else kwargs.get("generator")
            if given is None:
                if position < len(args):
                    args = args[:position] + (self.generator,) + args[position + 1:]
                else:
                    kwargs = {**kwargs, "generator": self.generator}
            return func(*args, **kwargs)
        with _GLOBAL_SWAP:
            saved = torch.random.default_generator.get_state()
            torch.random.default_generator.set_state(self.generator.get_state())
            try:
                return func(*args, **kwargs)
            finally:
                self.generator.set_state(torch.random.default_generator.get_state())
                torch.random.default_generator.set_state(saved)
