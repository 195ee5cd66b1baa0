"""Weights torn across optimizer steps by a failure: detected, and refused when read.

[Note: torn weights]
The optimizer thread steps one bucket at a time and writes each compute copy back after its step, so a failure in
any thread while a step is being applied (an error in the optimizer, a write-back or a gradient commit the step
waits for, or a worker of the next pass) leaves some layers at step k and others at step k-1. Rolling back would
need a second copy of every weight and its optimizer state in host memory, which is the memory this engine exists
to save; completing the step is impossible when the gradients it needs never arrived. So the engine keeps, per
bucket, the step its optimizer copy holds (`steps.optim`) and the step its compute copy holds (`steps.compute`), and
once it has failed, reading the module (`engine.module`, `module.state_dict()`, `save_pretrained`, checkpoints)
raises `TornWeightsError` when the compute copies hold different steps, naming which layers hold which step. A
failure that leaves every compute copy at one step (an error in a forward before any step, or in the first bucket
of a step) keeps the module readable: it is a model after that many steps. Resume from the last checkpoint.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

from ..common.sync import EngineClosedError, FailureFlag
from .host_store import Bucket, StepCount


class TornWeightsError(EngineClosedError):
    """The engine failed while an optimizer step was being applied; the module's layers hold different steps."""


def _layer_ranges(layers: list[int]) -> str:
    layers = sorted(set(layers))
    parts, start = [], None
    for i, layer in enumerate(layers):
        if start is None:
            start = layer
        if i + 1 == len(layers) or layers[i + 1] != layer + 1:
            parts.append(f"{start}" if start == layer else f"{start}-{layer}")
            start = None
    return ", ".join(parts)


def steps_by_layer(counts: Iterable[tuple[tuple[int, ...], StepCount]]) -> dict[int, list[int]]:
    """step -> the layers whose current version holds it (the compute copy, or the optimizer copy after an exact
    step not yet written back)."""
    found: dict[int, list[int]] = {}
    for layers, count in counts:
        found.setdefault(count.current, []).extend(layers)
    return found


class TornGuard:
    """Raises `TornWeightsError` when a failed engine's weights are read while torn ([Note: torn weights]). Holds
    the step counts and the failure flag, never the engine or its buffers, so it can sit on the user's module as a
    state-dict hook without keeping host memory alive."""

    def __init__(self, buckets: list[Bucket], failure: FailureFlag) -> None:
        self.counts = [(b.layers, b.steps) for b in buckets if b.trainable]
        self.failure = failure
        # Writes the exact steps' optimizer copies into the compute copies once the optimizer thread is still (a
        # `weakref.WeakMethod` of the engine's optimizer; see `follow_optimizer`).
        self.write_back = None

    def follow_optimizer(self, write_back_after_failure) -> None:
        """The engine wrapped an optimizer: after a failure, its exact steps not yet written back are written with
        `write_back_after_failure` (held weakly: the guard sits on the user's module and must not keep it alive)."""
        self.write_back = weakref.WeakMethod(write_back_after_failure)

    def check(self) -> None:
        if self.failure.error is None:
            return
        steps = steps_by_layer(self.counts)
        if len(steps) <= 1:
            if any(count.current_in_optim for _, count in self.counts):
                self._write_back_current()
            return
        held = "; ".join(f"{'layer' if len(set(layers)) == 1 else 'layers'} {_layer_ranges(layers)} "
                         f"{'holds' if len(set(layers)) == 1 else 'hold'} step {step}"
                         for step, layers in sorted(steps.items()))
        raise TornWeightsError(
            f"the RoundPipe engine failed ({self.failure.where}: {self.failure.error}) while an optimizer step was "
            f"being applied, so the model's weights mix steps: {held}. They are not saved or read as a model: "
            f"resume from your last checkpoint (Trainer: resume_from_checkpoint=True) with a new engine.")

    def _write_back_current(self) -> None:
        """Every layer is at one step, held by the optimizer copies of an exact step never written back: write it
        into the compute copies, which the reader is about to see ([Note: exact step without write-back])."""
        write_back = self.write_back() if self.write_back is not None else None
        if write_back is None:
            raise TornWeightsError(
                f"the RoundPipe engine failed ({self.failure.where}: {self.failure.error}) before its newest weights "
                f"were written into the model, and its optimizer is gone. Resume from your last checkpoint.")
        write_back()

    def __call__(self, module, prefix: str = "", keep_vars: bool = False) -> None:  # a state-dict pre-hook
        self.check()
