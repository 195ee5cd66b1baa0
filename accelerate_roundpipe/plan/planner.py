"""Forward and backward partitions from measured layer costs: the slowest stage as fast as the GPU memory allows.

Stage cost model (one task = one stage over the m micro-batches of a round; P, G = parameter and gradient bytes of the
stage's layers, X = the largest layer input, i.e. one micro-batch's activation crossing PCIe, bw = PCIe bytes/s per
direction; PCIe is full duplex, so upload and download are timed apart and overlap the compute):

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
(a wider span never costs less), which is what makes the greedy check below exact; for a decoder-only LM the layer
inputs are all the hidden state anyway, except the token ids the embedding reads.

Objective: minimise the slowest stage of the round (F, FB and B alike: the devices pass micro-batches around one
ring, so the slowest slot paces it), every stage within the GPU memory budget; then the fewest stages (less per-task
overhead), with at least min(num_devices, layers) backward stages so every device gets work. Forward and backward
are cut independently (the asymmetric split): both are packed up to the same bottleneck, so a forward stage holds
about 3x the layers of a backward stage.

Search. Splitting a stage never makes it slower or bigger, so with the fused stage [f, L) fixed, the best bottleneck
is the slowest single layer below f: T* = min over f of max(FB(f, L), slowest single F below f, slowest single B
below f), an O(L) scan. The fewest stages under T* come from the largest fused stage that stays within T* (fewer
layers below it never need more stages), then a greedy O(L) packing of each side, which gives the fewest stages for
monotone costs. Among partitions with that many stages the planner then balances each side (the smallest slowest
stage for that count): a parametric search over bottleneck values, bisecting between a bound known infeasible and a
bound known feasible. A feasible check lowers the upper bound to the greedy partition's actual slowest stage; an
infeasible check raises the lower bound to the cheapest one-layer extension of one of its stages, the next value at
which the greedy partition can change. The upper bound is always an achieved slowest stage and nothing below the
lower bound is feasible, so when they meet the search has the exact optimum: about a dozen O(L) checks (14 at 94
layers) instead of the paper's O(L^2) candidates times O(L) (1.47 s at 94 layers).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate

from ..config import RECOMPUTE_GRAINS
from .layer_costs import LayerCosts, drifted
from .partition import Partition, Span
from .schedule import TaskKind

F, FB, B = TaskKind.FORWARD, TaskKind.FUSED, TaskKind.BACKWARD


@dataclass(frozen=True)
class PlanSettings:
    """What a plan was made for, besides the layer costs."""

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
        self.costs, self.settings = costs, settings
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
        self._acts = prefix(costs.act_bytes)
        self._inputs = prefix(costs.input_bytes)
        self._act = [float(a) for a in costs.act_bytes]
        self._work = [float(w) for w in costs.work_bytes]
        self._boundary = float(max(costs.input_bytes, default=0))

    def compute(self, kind: TaskKind, start: int, stop: int) -> float:
        prefix = self._fwd if kind is F else self._bwd if kind is B else self._fused
        return self._m * (prefix[stop] - prefix[start])

    def time(self, kind: TaskKind, start: int, stop: int) -> float:
        m, x = self._m, self._boundary
        params = self._params[stop] - self._params[start]
        saved = self._inputs[stop] - self._inputs[start] if self._layer_grain else 0.0
        if kind is F:
            up, down = params + m * x, m * (x + saved)
        else:
            down = self._grads[stop] - self._grads[start] + m * x
            if kind is B:
                up = params + m * (x + (saved if self._layer_grain else x))
            else:
                up = params + m * x
        return max(self.compute(kind, start, stop), up / self._bw, down / self._bw)

    def memory_parts(self, kind: TaskKind, start: int, stop: int) -> dict[str, float]:
        params = self._params[stop] - self._params[start]
        whole_graph = kind is FB or (kind is B and not self._layer_grain)
        return {
            "parameters": params,
            "prefetch": params,
            "gradients": 0.0 if kind is F else self._grads[stop] - self._grads[start],
            "activations": self._acts[stop] - self._acts[start] if whole_graph else max(self._act[start:stop]),
            "backward working set": 0.0 if kind is F else max(self._work[start:stop]),
            "in flight": 2 * self._boundary,
        }

    def memory(self, kind: TaskKind, start: int, stop: int) -> float:
        # The sum of memory_parts, inlined: the search calls this for every span it tries.
        params = self._params[stop] - self._params[start]
        if kind is F:
            return 2 * params + max(self._act[start:stop]) + 2 * self._boundary
        whole_graph = kind is FB or not self._layer_grain
        acts = self._acts[stop] - self._acts[start] if whole_graph else max(self._act[start:stop])
        # + the largest working set: a layer's backward (or a forward's temporaries) on top of what is kept.
        return 2 * params + self._grads[stop] - self._grads[start] + acts + max(self._work[start:stop]) \
            + 2 * self._boundary

    def cost(self, kind: TaskKind, start: int, stop: int) -> float:
        """The stage's time, or infinity when it does not fit the memory budget."""
        if self.memory(kind, start, stop) > self.budget:
            return math.inf
        return self.time(kind, start, stop)


@dataclass(frozen=True)
class PlannedPartition:
    """A partition with its predicted per-stage times (seconds per task) and GPU memory (bytes).

    `forward_stage_*` follow `partition.forward`, `backward_stage_*` follow `partition.backward` (the last entry is
    the fused stage).
    """

    partition: Partition
    slowest_stage_s: float
    forward_stage_s: tuple[float, ...]
    backward_stage_s: tuple[float, ...]
    forward_stage_bytes: tuple[float, ...]
    backward_stage_bytes: tuple[float, ...]
    search_s: float
    settings: PlanSettings
    costs: LayerCosts = field(repr=False)

    def rows(self) -> list[tuple[str, Span, float, float]]:
        """(stage name as the schedule writes it, span, time, memory) in round order: F_0.., FB, B_{Sb-2}..B_0."""
        p = self.partition
        top = len(p.backward) - 1
        rows = [(f"F{i}", s, t, mem) for i, (s, t, mem) in
                enumerate(zip(p.forward, self.forward_stage_s, self.forward_stage_bytes))]
        rows.append((f"FB{top}", p.fused, self.backward_stage_s[top], self.backward_stage_bytes[top]))
        rows += [(f"B{i}", p.backward[i], self.backward_stage_s[i], self.backward_stage_bytes[i])
                 for i in reversed(range(top))]
        return rows

    def __str__(self) -> str:
        s = self.settings
        lines = [f"planned {self.partition}",
                 f"slowest stage {_ms(self.slowest_stage_s)}, budget {_size(s.gpu_memory_bytes)}, "
                 f"{s.num_microbatches} micro-batches per task, {s.num_devices} devices, recompute={s.recompute}, "
                 f"searched in {self.search_s * 1e3:.2f} ms",
                 f"{'stage':<6} {'layers':<10} {'time':>12} {'memory':>12}"]
        for name, span, t, mem in self.rows():
            mark = "  <- slowest" if t == self.slowest_stage_s else ""
            lines.append(f"{name:<6} {str(span):<10} {_ms(t):>12} {_size(mem):>12}{mark}")
        return "\n".join(lines)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3f} {unit}"
    return f"{nbytes:.0f} B"


# ----------------------------------------------------------------------------------------------------------- search


def _greedy(model: StageCostModel, kind: TaskKind, lo: int, hi: int, bound: float,
            from_top: bool) -> tuple[list[Span], float]:
    """Pack layers [lo, hi) into the fewest stages of cost <= bound (every single layer must meet it), from the top
    or the bottom. Also returns the smallest cost of a stage grown by one layer (inf if none can grow): below that
    bound this packing does not change."""
    spans: list[Span] = []
    next_bound = math.inf
    cost = model.cost
    if from_top:
        stop = hi
        while stop > lo:
            start = stop - 1
            while start > lo:
                grown = cost(kind, start - 1, stop)
                if grown > bound:
                    next_bound = min(next_bound, grown)
                    break
                start -= 1
            spans.append(Span(start, stop))
            stop = start
        spans.reverse()
    else:
        start = lo
        while start < hi:
            stop = start + 1
            while stop < hi:
                grown = cost(kind, start, stop + 1)
                if grown > bound:
                    next_bound = min(next_bound, grown)
                    break
                stop += 1
            spans.append(Span(start, stop))
            start = stop
    return spans, next_bound


def _split_to(model: StageCostModel, kind: TaskKind, spans: list[Span], parts: int) -> list[Span]:
    """Split the costliest multi-layer stage at its most even point until there are `parts` stages."""
    spans = list(spans)
    while len(spans) < parts:
        index = max((i for i, s in enumerate(spans) if len(s) > 1), key=lambda i: model.cost(kind, *spans[i]))
        s = spans[index]
        cut = min(range(s.start + 1, s.stop),
                  key=lambda c: max(model.cost(kind, s.start, c), model.cost(kind, c, s.stop)))
        spans[index:index + 1] = [Span(s.start, cut), Span(cut, s.stop)]
    return spans


def _balanced(model: StageCostModel, kind: TaskKind, lo: int, hi: int, parts: int, feasible_bound: float,
              from_top: bool) -> list[Span]:
    """The partition of [lo, hi) into exactly `parts` stages whose slowest stage is the smallest (parametric
    search, see the module docstring). `feasible_bound` must admit a packing into at most `parts` stages."""
    best, _ = _greedy(model, kind, lo, hi, feasible_bound, from_top)
    upper = max(model.cost(kind, *s) for s in best)
    # Infeasible below: no stage is cheaper than its slowest layer, and `parts` stages share the total compute.
    lower = max(max(model.cost(kind, i, i + 1) for i in range(lo, hi)), model.compute(kind, lo, hi) / parts)
    while lower < upper:
        bound = lower + (upper - lower) / 2
        if bound >= upper:
            bound = lower
        spans, next_bound = _greedy(model, kind, lo, hi, bound, from_top)
        if len(spans) <= parts:
            best, upper = spans, max(model.cost(kind, *s) for s in spans)
        else:
            lower = next_bound
    return _split_to(model, kind, best, parts)


def check_every_layer_fits(model: StageCostModel) -> None:
    """Each layer must fit alone: as a backward stage (F needs less) or, the top layer, as the fused stage."""
    top = model.num_layers - 1
    for layer in range(model.num_layers):
        kind = FB if layer == top else B
        parts = model.memory_parts(kind, layer, layer + 1)
        need = sum(parts.values())
        if need <= model.budget:
            continue
        detail = " + ".join(f"{name} {_size(v)}" for name, v in parts.items())
        knobs = ["raise num_microbatches (env ROUNDPIPE_NUM_MICROBATCHES) for smaller micro-batches"]
        if kind is B and model.settings.recompute == "stage":
            knobs.append("set recompute='layer' (env ROUNDPIPE_RECOMPUTE) to keep one layer's graph at a time")
        knobs.append("use shorter sequences")
        if 2 * parts["parameters"] + parts["gradients"] > model.budget:
            knobs = ["its parameters (with the next task's copy arriving by prefetch) and gradients alone exceed the "
                     "budget: use a lower-precision compute copy (param_dtype) or split the layer into several "
                     "pipeline layers"]
        raise ValueError(f"layer {layer} alone needs {_size(need)} of GPU memory as a {kind.name.lower()} stage "
                         f"({detail}), more than the budget of {_size(model.budget)}. Knobs: {'; '.join(knobs)}.")


def plan_from_costs(costs: LayerCosts, *, num_devices: int, num_microbatches: int, gpu_memory_bytes: float,
                    pcie_bytes_per_s: float, recompute: str = "stage") -> PlannedPartition:
    """The partition whose slowest stage is fastest within `gpu_memory_bytes` per stage, then with the fewest stages
    (at least min(num_devices, layers) backward ones), each side balanced. `num_microbatches` is the number of
    micro-batches one task runs (the round size). Raises ValueError naming the layer that cannot fit alone."""
    started = time.perf_counter()
    settings = PlanSettings(num_devices, num_microbatches, gpu_memory_bytes, pcie_bytes_per_s, recompute)
    num_layers = costs.num_layers
    if num_layers < 1:
        raise ValueError("RoundPipe needs a model with at least one layer.")
    model = StageCostModel(costs, settings)
    check_every_layer_fits(model)

    # Slowest single forward / backward stage among the layers below each possible fused start f.
    below_f = [0.0]
    for layer in range(num_layers - 1):
        below_f.append(max(below_f[-1], model.time(F, layer, layer + 1), model.time(B, layer, layer + 1)))
    first_fused = min(num_devices, num_layers) - 1  # leaves room below for the backward stages every device needs
    candidates = range(first_fused, num_layers)
    bottleneck = min(max(model.cost(FB, f, num_layers), below_f[f]) for f in candidates)
    # The largest fused stage within the bottleneck leaves the fewest layers, hence stages, below it.
    fused_start = next(f for f in candidates if model.cost(FB, f, num_layers) <= bottleneck)

    forward: list[Span] = []
    backward: list[Span] = []
    if fused_start:
        backward_count = len(_greedy(model, B, 0, fused_start, bottleneck, from_top=True)[0])
        backward = _balanced(model, B, 0, fused_start, max(backward_count, first_fused), bottleneck, from_top=True)
        forward_count = len(_greedy(model, F, 0, fused_start, bottleneck, from_top=False)[0])
        forward = _balanced(model, F, 0, fused_start, forward_count, bottleneck, from_top=False)
    backward.append(Span(fused_start, num_layers))
    partition = Partition(num_layers=num_layers, forward=tuple(forward), backward=tuple(backward))

    kinds = [B] * (len(backward) - 1) + [FB]
    forward_s = tuple(model.time(F, *s) for s in forward)
    backward_s = tuple(model.time(k, *s) for k, s in zip(kinds, backward))
    return PlannedPartition(
        partition=partition,
        slowest_stage_s=max(forward_s + backward_s),
        forward_stage_s=forward_s,
        backward_stage_s=backward_s,
        forward_stage_bytes=tuple(model.memory(F, *s) for s in forward),
        backward_stage_bytes=tuple(model.memory(k, *s) for k, s in zip(kinds, backward)),
        search_s=time.perf_counter() - started,
        settings=settings,
        costs=costs,
    )


def replan_if_drifted(previous: PlannedPartition | None, costs: LayerCosts, *, tolerance: float = 0.15,
                      num_devices: int, num_microbatches: int, gpu_memory_bytes: float, pcie_bytes_per_s: float,
                      recompute: str = "stage") -> PlannedPartition:
    """The cached plan `previous` while the settings are unchanged and `costs` stay within `tolerance` of the costs
    it was made from (`layer_costs.drifted`); a new plan otherwise. Cheap enough to call every few iterations."""
    settings = PlanSettings(num_devices, num_microbatches, gpu_memory_bytes, pcie_bytes_per_s, recompute)
    if previous is not None and previous.settings == settings and not drifted(previous.costs, costs, tolerance):
        return previous
    return plan_from_costs(costs, num_devices=num_devices, num_microbatches=num_microbatches,
                           gpu_memory_bytes=gpu_memory_bytes, pcie_bytes_per_s=pcie_bytes_per_s, recompute=recompute)
