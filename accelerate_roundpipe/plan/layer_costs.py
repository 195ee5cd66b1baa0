"""Measured per-layer costs, the planner's input: times per micro-batch and bytes, plain data that round-trips JSON.

The profiler fills one `LayerCosts` from the first iterations; `drifted` tells when later measurements have moved far
enough from the ones a plan was made from that the plan should be made again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

_OPTIONAL = ("recompute_s", "param_bytes", "grad_bytes", "act_bytes", "input_bytes")


@dataclass(frozen=True)
class LayerCosts:
    """One entry per pipeline layer, bottom (input) to top (loss). Times are seconds per micro-batch.

    Fields:
        forward_s: forward of one micro-batch.
        backward_s: backward of one micro-batch, without the recomputation.
        recompute_s: the recomputing forward (with graph) a backward stage runs first. Default: `forward_s`.
        param_bytes: the layer's compute copy uploaded to the GPU.
        grad_bytes: its gradients, accumulated on the GPU and downloaded once per task (LoRA: only the adapters').
        act_bytes: activation memory one micro-batch of this layer holds on the GPU while a stage runs, including
            what its backward needs.
        input_bytes: the layer's input of one micro-batch: what crosses PCIe between stages and is kept on the host
            for recomputation.
        work_bytes: transient memory above what the layer keeps: the peak of its backward (the gradients of its
            activations, temporaries of its kernels) or of its forward beyond `act_bytes`, whichever is larger.
            Default: `act_bytes` (a layer's backward holds gradients of about its activations' size).

    Byte fields default to zeros (a time-only profile). Sequences are stored as tuples, so instances hash.
    """

    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    recompute_s: tuple[float, ...] | None = None
    param_bytes: tuple[float, ...] | None = None
    grad_bytes: tuple[float, ...] | None = None
    act_bytes: tuple[float, ...] | None = None
    input_bytes: tuple[float, ...] | None = None
    work_bytes: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        n = len(self.forward_s)
        defaults = {"recompute_s": self.forward_s, "work_bytes": self.act_bytes}
        for f in fields(self):
            values = getattr(self, f.name)
            if values is None:
                values = defaults.get(f.name)
                values = (0,) * n if values is None else values
            values = tuple(values)
            if len(values) != n:
                raise ValueError(f"LayerCosts.{f.name} has {len(values)} entries; forward_s has {n} (one per layer).")
            bad = [i for i, v in enumerate(values) if not v >= 0]  # `not >=` also catches NaN
            if bad:
                raise ValueError(f"LayerCosts.{f.name}: layer {bad[0]} has {values[bad[0]]!r}; costs must be >= 0.")
            object.__setattr__(self, f.name, values)  # frozen: the normalised tuple replaces what was passed

    @property
    def num_layers(self) -> int:
        return len(self.forward_s)

    def to_dict(self) -> dict[str, list[float]]:
        return {f.name: list(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Sequence[float]]) -> LayerCosts:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"LayerCosts.from_dict: unknown keys {unknown}; known keys are {sorted(known)}.")
        missing = [name for name in ("forward_s", "backward_s") if name not in data]
        if missing:
            raise ValueError(f"LayerCosts.from_dict: missing {missing}; forward_s and backward_s are required.")
        return cls(**{name: tuple(values) for name, values in data.items()})


def _stage_relevant_series(costs: LayerCosts) -> dict[str, tuple[float, ...]]:
    """The per-layer quantities whose sums over a span make up a stage's time and memory in the planner."""
    return {
        "forward_s": costs.forward_s,
        "recompute_s + backward_s": tuple(r + b for r, b in zip(costs.recompute_s, costs.backward_s)),
        "param_bytes + grad_bytes": tuple(p + g for p, g in zip(costs.param_bytes, costs.grad_bytes)),
        "act_bytes": costs.act_bytes,
        "input_bytes": costs.input_bytes,
    }


def drift_reasons(old: LayerCosts, new: LayerCosts, tolerance: float = 0.15) -> list[str]:
    """Why `new` is no longer close to `old` (empty when it is).

    For each stage-relevant quantity, the model total may change by at most `tolerance` of the old total, and each
    layer by at most `tolerance` of the larger of its old value and the old per-layer mean. Judging a layer against
    the mean keeps measurement noise on near-free layers (an embedding lookup) from forcing a re-plan: a stage's
    total can only move as much as its layers do, so no stage moves by much more than `tolerance` either.
    """
    if old.num_layers != new.num_layers:
        return [f"layer count changed from {old.num_layers} to {new.num_layers}"]
    reasons = []
    new_series = _stage_relevant_series(new)
    for name, before in _stage_relevant_series(old).items():
        after = new_series[name]
        old_total, new_total = sum(before), sum(after)
        if abs(new_total - old_total) > tolerance * old_total:
            reasons.append(f"total {name} {old_total:.4g} -> {new_total:.4g}")
            continue
        mean = old_total / len(before) if before else 0.0
        for layer, (b, a) in enumerate(zip(before, after)):
            if abs(a - b) > tolerance * max(b, mean):
                reasons.append(f"layer {layer} {name} {b:.4g} -> {a:.4g}")
                break
    return reasons


def drifted(old: LayerCosts, new: LayerCosts, tolerance: float = 0.15) -> bool:
    """True when a plan made from `old` should be made again for `new` (see `drift_reasons`)."""
    return bool(drift_reasons(old, new, tolerance))
