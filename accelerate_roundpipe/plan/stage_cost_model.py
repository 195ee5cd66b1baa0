"""The time and GPU memory of any stage, from the measured layer costs and the settings a plan is made for.

One task = one stage over the m micro-batches of a round; P, G = parameter and gradient bytes of the stage's layers
(for the transfers, what of them crosses PCIe: `upload_bytes`, `download_bytes`),
X = the largest layer input, i.e. one micro-batch's activation crossing PCIe, bw = PCIe bytes/s per direction; PCIe
is full duplex, so upload and download are timed apart and overlap the compute:

    kind  compute                    upload (host -> GPU)               download (GPU -> host)
    F     m * sum(forward_s)         P + m*X (input)                    m*X (output) [+ m * sum(input_bytes), layer]
    B     m * sum(recompute_s        P + m*X (output grad) + m*X        G + m*X (input grad)
              + backward_s)            (saved input) [m * sum(input_bytes) for it, layer]
    FB    m * sum(forward_s          P + m*X (input)                    G + m*X (input grad)
              + backward_s)

    time   = max(compute, upload / bw, download / bw)
    memory = 2P (the compute copy, and the next task's copy staged by prefetch: about one stage's worth)
             + G (B and FB)
             + activations of one micro-batch: sum(act_bytes) where the stage keeps its whole graph (FB; B with
               recompute='stage'), max(act_bytes) where one layer's is live at a time (F; B with recompute='layer')
             + max(work_bytes) for B and FB: the working set of the layer running (its backward's gradients and
               temporaries, measured as a peak; leaving it out let a fused stage run out of memory on an H200)
             + 2X (the micro-batch's input and output, or their gradients, in flight)

With recompute='stage' a forward stage also downloads the inputs kept for the backward stages starting inside it (a
few per iteration); the model leaves them out. Using X for every boundary keeps each stage's cost monotone in its span
(a wider span never costs less), which is what makes the planner's greedy check exact; for a decoder-only LM the layer
inputs are all the hidden state anyway, except the token ids the embedding reads.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

from ..config import RECOMPUTE_GRAINS
from .layer_costs import LayerCosts
from .schedule import TaskKind

F, FB, B = TaskKind.FORWARD, TaskKind.FUSED, TaskKind.BACKWARD

# The parts of a stage's memory, in the order `StageCostModel._memory_parts` gives them. The prefetch is the next
# task's parameters arriving; the backward working set is a layer's backward (or a forward's temporaries) on top of
# what the stage keeps.
MEMORY_PARTS = ("parameters", "prefetch", "gradients", "activations", "backward working set", "in flight")


@dataclass(frozen=True)
class PlanSettings:
    """What a plan is made for, besides the layer costs."""

    num_devices: int
    num_microbatches: int  # micro-batches one task runs: the round size (microbatches_per_round)
    gpu_memory_bytes: float
    pcie_bytes_per_s: float
    recompute: str = "stage"

    def __post_init__(self) -> None:
        if self.num_devices < 1 or self.num_microbatches < 1:
            raise ValueError(f"need at least one device and one micro-batch per task, got num_devices="
                             f"{self.num_devices}, num_microbatches={self.num_microbatches}.")
        if not self.gpu_memory_bytes > 0 or not self.pcie_bytes_per_s > 0:
            raise ValueError(f"gpu_memory_bytes ({self.gpu_memory_bytes}) and pcie_bytes_per_s "
                             f"({self.pcie_bytes_per_s}) must be > 0.")
        if self.recompute not in RECOMPUTE_GRAINS:
            raise ValueError(f"recompute={self.recompute!r}; choose one of {list(RECOMPUTE_GRAINS)}.")


class StageCostModel:
    """Time and memory of any stage (kind, layers [start, stop)) under the model in the module docstring; O(1) per
    stage apart from the max over activations (a C-speed slice)."""

    def __init__(self, costs: LayerCosts, settings: PlanSettings) -> None:
        self.settings = settings
        self.num_layers = costs.num_layers
        self.budget = settings.gpu_memory_bytes
        self._m = settings.num_microbatches
        self._bw = settings.pcie_bytes_per_s
        self._layer_grain = settings.recompute == "layer"

        def prefix(values: Sequence[float]) -> list[float]:
            return [0.0, *accumulate(float(v) for v in values)]

        self._fwd = prefix(costs.forward_s)
        self._bwd = prefix(r + b for r, b in zip(costs.recompute_s, costs.backward_s))
        self._fused = prefix(f + b for f, b in zip(costs.forward_s, costs.backward_s))
        self._params = prefix(costs.param_bytes)
        self._grads = prefix(costs.grad_bytes)
        self._uploads = prefix(costs.upload_bytes)
        self._downloads = prefix(costs.download_bytes)
        self._acts = prefix(costs.act_bytes)
        self._inputs = prefix(costs.input_bytes)
        self._act = [float(a) for a in costs.act_bytes]
        self._work = [float(w) for w in costs.work_bytes]
        self._boundary = float(max(costs.input_bytes, default=0))

    def compute(self, kind: TaskKind, start: int, stop: int) -> float:
        prefix = self._fwd if kind is F else self._bwd if kind is B else self._fused
        return self._m * (prefix[stop] - prefix[start])

    def transfer_bytes(self, kind: TaskKind, start: int, stop: int) -> tuple[float, float, float, float]:
        """The table's transfers of one task, split into what it moves once (weights up, gradients down) and what
        it moves per micro-batch (activations): (upload per task, upload per micro-batch, download per task,
        download per micro-batch). A task over m micro-batches moves `per task + m * per micro-batch`."""
        x = self._boundary
        params = self._uploads[stop] - self._uploads[start]
        saved = self._inputs[stop] - self._inputs[start] if self._layer_grain else 0.0
        if kind is F:
            return params, x, 0.0, x + saved
        grads = self._downloads[stop] - self._downloads[start]
        if kind is B:
            return params, x + (saved if self._layer_grain else x), grads, x
        return params, x, grads, x

    def time(self, kind: TaskKind, start: int, stop: int) -> float:
        m = self._m
        up_task, up_mb, down_task, down_mb = self.transfer_bytes(kind, start, stop)
        return max(self.compute(kind, start, stop), (up_task + m * up_mb) / self._bw,
                   (down_task + m * down_mb) / self._bw)

    def memory_parts(self, kind: TaskKind, start: int, stop: int) -> dict[str, float]:
        """The stage's memory by part (`MEMORY_PARTS`), for error messages."""
        return dict(zip(MEMORY_PARTS, self._memory_parts(kind, start, stop)))

    def memory(self, kind: TaskKind, start: int, stop: int) -> float:
        return sum(self._memory_parts(kind, start, stop))

    def _memory_parts(self, kind: TaskKind, start: int, stop: int) -> tuple[float, ...]:
        # A tuple, not a dict: the planners' search calls memory() for every span it tries.
        params = self._params[stop] - self._params[start]
        whole_graph = kind is FB or (kind is B and not self._layer_grain)
        return (
            params,
            params,
            0.0 if kind is F else self._grads[stop] - self._grads[start],
            self._acts[stop] - self._acts[start] if whole_graph else max(self._act[start:stop]),
            0.0 if kind is F else max(self._work[start:stop]),
            2 * self._boundary,
        )

    def time_if_fits(self, kind: TaskKind, start: int, stop: int) -> float:
        """The stage's time, or infinity when it does not fit the memory budget: what the planners minimise."""
        if self.memory(kind, start, stop) > self.budget:
            return math.inf
        return self.time(kind, start, stop)


def check_every_layer_fits(model: StageCostModel) -> None:
    """Each layer must fit alone: as a backward stage (F needs less) or, the top layer, as the fused stage."""
    top = model.num_layers - 1
    for layer in range(model.num_layers):
        kind = FB if layer == top else B
        parts = model.memory_parts(kind, layer, layer + 1)
        need = sum(parts.values())
        if need <= model.budget:
            continue
        detail = " + ".join(f"{name} {format_bytes(v)}" for name, v in parts.items())
        knobs = ["raise num_microbatches (env ROUNDPIPE_NUM_MICROBATCHES) for smaller micro-batches"]
        if kind is B and model.settings.recompute == "stage":
            knobs.append("set recompute='layer' (env ROUNDPIPE_RECOMPUTE) to keep one layer's graph at a time")
        knobs.append("use shorter sequences")
        if 2 * parts["parameters"] + parts["gradients"] > model.budget:
            knobs = ["its parameters (with the next task's copy arriving by prefetch) and gradients alone exceed the "
                     "budget: use a lower-precision compute copy (param_dtype) or split the layer into several "
                     "pipeline layers"]
        raise ValueError(f"layer {layer} alone needs {format_bytes(need)} of GPU memory as a {kind.name.lower()} "
                         f"stage ({detail}), more than the budget of {format_bytes(model.budget)}. "
                         f"Knobs: {'; '.join(knobs)}.")


def format_bytes(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3f} {unit}"
    return f"{nbytes:.0f} B"
