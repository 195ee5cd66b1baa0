"""Forward and backward stage partitions, chosen independently (the asymmetric split).

A backward stage recomputes its forward and then runs the backward, about 3x the forward cost, so with equal-cost
slots forward stages hold about 3x the layers of backward stages. The planner packs layers greedily up to a slot
budget `t_max`: backward stages from the top (the first backward stage, the fused one, is filled first: its forward
doubles as the recomputation), forward stages from the bottom over the layers below the fused stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

# Backward with recomputation = recompute (1x) + backward (about 2x) of the forward cost.
DEFAULT_BACKWARD_TO_FORWARD_COST = 3.0


class Span(NamedTuple):
    """Layers [start, stop) of one stage."""

    start: int
    stop: int

    def __str__(self) -> str:
        return f"L{self.start}-{self.stop - 1}"

    def __len__(self) -> int:  # type: ignore[override]
        return self.stop - self.start

    @property
    def layers(self) -> range:
        return range(self.start, self.stop)


@dataclass(frozen=True)
class Partition:
    """Stage spans of a model of `num_layers` layers.

    `forward` covers the layers below the fused stage, bottom to top. `backward` covers every layer, bottom to top;
    `backward[-1]` is the fused stage.
    """

    num_layers: int
    forward: tuple[Span, ...]
    backward: tuple[Span, ...]

    def __post_init__(self) -> None:
        _check_cover(self.backward, 0, self.num_layers, "backward_stages")
        _check_cover(self.forward, 0, self.fused.start, "forward_stages")

    @property
    def fused(self) -> Span:
        return self.backward[-1]

    @property
    def forward_all(self) -> tuple[Span, ...]:
        """Forward stages over every layer (forward-only passes): the fused span runs as one more forward stage."""
        return self.forward + (self.fused,)

    def one_stage(self) -> Partition:
        """Every layer in one stage: what a forward-only pass runs when stages buy nothing
        ([Note: one-stage evaluation] in runtime/engine/pass_launch.py)."""
        return Partition(self.num_layers, forward=(), backward=(Span(0, self.num_layers),))

    def saved_input_layers(self, recompute: str, fused: bool = True) -> frozenset[int]:
        """Layers whose input the forward pass keeps on the host for the backward's recomputation."""
        backward = self.backward[:-1] if fused else self.backward
        if recompute == "layer":
            return frozenset(layer for span in backward for layer in span.layers)
        return frozenset(span.start for span in backward)

    def __str__(self) -> str:
        fwd = " ".join(str(s) for s in self.forward) or "-"
        bwd = " ".join(str(s) for s in self.backward[:-1]) or "-"
        return f"forward [{fwd}] fused [{self.fused}] backward [{bwd}]"


def _check_cover(spans: Sequence[Span], start: int, stop: int, knob: str) -> None:
    position = start
    for span in spans:
        if span.start != position or span.stop <= span.start:
            raise ValueError(f"{knob}: stages {[str(s) for s in spans]} do not tile layers {start}..{stop - 1}.")
        position = span.stop
    if position != stop:
        raise ValueError(f"{knob}: stages {[str(s) for s in spans]} cover layers up to {position - 1}, "
                         f"expected up to {stop - 1}.")


def spans_from_counts(counts: Sequence[int], start: int = 0) -> tuple[Span, ...]:
    spans, position = [], start
    for count in counts:
        spans.append(Span(position, position + count))
        position += count
    return tuple(spans)


def _pack(costs: Sequence[float], budget: float) -> list[int]:
    """Greedy packing of consecutive costs into groups of total <= budget (a group holds at least one)."""
    counts: list[int] = []
    total = 0.0
    for cost in costs:
        if counts and total + cost <= budget * 1.01:  # a near-free layer (an embedding) never makes a stage alone
            counts[-1] += 1
            total += cost
        else:
            counts.append(1)
            total = cost
    return counts


def plan_partition(
    num_layers: int,
    forward_costs: Sequence[float] | None = None,
    backward_costs: Sequence[float] | None = None,
    max_stage_cost: float | None = None,
    forward_stages: Sequence[int] | None = None,
    backward_stages: Sequence[int] | None = None,
) -> Partition:
    """Partition `num_layers` layers into backward stages (top first) and forward stages (bottom first).

    Costs default to 1 per layer forward and 3 per layer backward. `max_stage_cost` (the slot budget) defaults to
    the most expensive single layer, which is the smallest budget every stage can meet. Explicit layer counts
    (`forward_stages`, `backward_stages`, config fields of the same names) override the planner.
    """
    if num_layers < 1:
        raise ValueError("RoundPipe needs a model with at least one layer.")
    fwd = list(forward_costs) if forward_costs is not None else [1.0] * num_layers
    bwd = list(backward_costs) if backward_costs is not None else [DEFAULT_BACKWARD_TO_FORWARD_COST * c for c in fwd]
    if len(fwd) != num_layers or len(bwd) != num_layers:
        raise ValueError(f"got {len(fwd)} forward and {len(bwd)} backward costs for {num_layers} layers.")
    budget = max_stage_cost if max_stage_cost is not None else max(max(bwd), max(fwd))

    if backward_stages is not None:
        if sum(backward_stages) != num_layers:
            raise ValueError(f"backward_stages {list(backward_stages)} sum to {sum(backward_stages)} layers; the model "
                             f"has {num_layers}. Make the counts add up to {num_layers}.")
        backward = spans_from_counts(backward_stages)
    else:
        top_down = _pack(list(reversed(bwd)), budget)
        backward = spans_from_counts(list(reversed(top_down)))

    fused_start = backward[-1].start
    if forward_stages is not None:
        if sum(forward_stages) != fused_start:
            raise ValueError(f"forward_stages {list(forward_stages)} sum to {sum(forward_stages)} layers; the layers "
                             f"below the fused stage are {fused_start}. Make the counts add up to {fused_start}.")
        forward = spans_from_counts(forward_stages)
    else:
        forward = spans_from_counts(_pack(fwd[:fused_start], budget)) if fused_start else ()
    return Partition(num_layers=num_layers, forward=forward, backward=backward)
