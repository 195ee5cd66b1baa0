"""Measured per-layer costs, the planner's input: times per micro-batch and bytes, plain data that round-trips JSON.

The profiler (`runtime/execution/layer_profile.py`) fills one `LayerCosts` from the measured training pass; the stage
cost model (`stage_cost_model.py`) sums it over spans.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields


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
        upload_bytes: what of `param_bytes` crosses PCIe to the GPU per task (a bucket whose optimizer state lives
            on the GPU is read there: nothing crosses). Default: `param_bytes`.
        download_bytes: what its gradients put on PCIe per backward task, in the host's gradient dtype (none for
            a bucket kept on the GPU). Default: `grad_bytes`.

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
    upload_bytes: tuple[float, ...] | None = None
    download_bytes: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        n = len(self.forward_s)
        # Each default is an earlier field, already normalised when the loop reaches the field it fills.
        defaults = {"recompute_s": "forward_s", "work_bytes": "act_bytes", "upload_bytes": "param_bytes",
                    "download_bytes": "grad_bytes"}
        for f in fields(self):
            values = getattr(self, f.name)
            if values is None:
                values = getattr(self, defaults[f.name]) if f.name in defaults else (0,) * n
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
