"""The LM head cut into vocabulary shards: their costs, and the shard count the planner picks.

[Note: split head]
The head (final norm, lm_head, loss) of a long-vocabulary model costs several decoder layers (Qwen3-1.7B: 5.3 at
s4096), and as one indivisible pipeline layer it is the slowest stage of every plan on several devices: the ring of
devices runs at its pace. Cut along the vocabulary it becomes K pipeline layers, shard k holding rows
[k V / K, (k + 1) V / K) of the lm_head. Each shard computes its logits, folds them into per-token online-softmax
statistics it passes on (the log-sum-exp so far and the target's logit, `models/vocab_shards.py`), and the last one
turns the statistics into the loss; the backward is exact (the gradient of the logits is softmax - one-hot, shard by
shard). A shard costs 1/K of the head in compute, parameters, gradients and logits memory; what crosses between
shards is the normed hidden state (the head's own input size) and two numbers per token.

The shard count is a planning choice like any other: `plan_split_head` plans the model with the head cut into
K = 1..`max_head_shards` shards and keeps the K whose plan has the fastest slowest stage, then the fewest stages, then
the smallest K. The shards are then grouped into stages by the same planner as the decoder layers.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, fields

from .decoder_shapes import DecoderShape, decoder_layer_flops
from .layer_costs import LayerCosts
from .planned_partition import PlannedPartition
from .planner import plan_from_costs
from .stage_cost_model import PlanSettings

# Costs of a shard that are not divided by K: what every shard reads whole.
_WHOLE_PER_SHARD = ("input_bytes", "act_bytes")


def split_head_costs(costs: LayerCosts, num_head_shards: int) -> LayerCosts:
    """`costs` with its last layer (the head) replaced by `num_head_shards` equal vocabulary shards
    ([Note: split head]): each shard takes 1/K of the head's times and of its parameter, gradient and working bytes
    (the logits of a loss chunk), and reads and keeps the whole hidden state (`input_bytes` and `act_bytes`
    unchanged). With K > 1 a shard's backward also recomputes its logits (it keeps none: see
    [Note: vocabulary shards] in `models/vocab_shards.py`), so its `backward_s` gains its `forward_s`."""
    if num_head_shards < 1:
        raise ValueError(f"num_head_shards must be at least 1, got {num_head_shards}.")
    if costs.num_layers < 2:
        raise ValueError("splitting the head needs a model with a head and at least one layer below it.")
    if num_head_shards == 1:
        return costs
    values = {}
    for f in fields(costs):
        per_layer = list(getattr(costs, f.name))
        head = per_layer.pop()
        shard = head if f.name in _WHOLE_PER_SHARD else head / num_head_shards
        if f.name == "backward_s":
            shard += costs.forward_s[-1] / num_head_shards
        values[f.name] = per_layer + [shard] * num_head_shards
    return LayerCosts(**values)


@dataclass(frozen=True)
class SplitHeadPlan:
    """The planner's choice of head shards and the plan of the model with its head cut into that many.

    `planned.partition` indexes the layers of `costs`: the model's layers below the head, then the shards.
    `slowest_by_shards[k - 1]` is the slowest stage of the best plan with k shards (inf where nothing fits).
    """

    num_head_shards: int
    planned: PlannedPartition
    costs: LayerCosts
    slowest_by_shards: tuple[float, ...]
    search_s: float

    @property
    def head_layers(self) -> range:
        """The layer indices of the shards in `costs`."""
        return range(self.costs.num_layers - self.num_head_shards, self.costs.num_layers)

    def __str__(self) -> str:
        tried = ", ".join(f"{k + 1}: {t * 1e3:.3f} ms" for k, t in enumerate(self.slowest_by_shards))
        return (f"head in {self.num_head_shards} vocabulary shards (layers {self.head_layers.start}-"
                f"{self.head_layers.stop - 1}); slowest stage by shard count: {tried}; searched in "
                f"{self.search_s * 1e3:.2f} ms\n{self.planned}")


def plan_split_head(costs: LayerCosts, settings: PlanSettings, max_head_shards: int = 16) -> SplitHeadPlan:
    """Plan `costs` (its last layer the head) with the head cut into 1..`max_head_shards` vocabulary shards and keep
    the fastest slowest stage, then the fewest stages, then the fewest shards ([Note: split head]). Raises the
    planner's ValueError when no shard count fits the memory budget (the message of the smallest shard count)."""
    if max_head_shards < 1:
        raise ValueError(f"max_head_shards must be at least 1, got {max_head_shards}.")
    started = time.perf_counter()
    best: tuple | None = None
    slowest: list[float] = []
    first_error: ValueError | None = None
    for shards in range(1, max_head_shards + 1):
        split = split_head_costs(costs, shards)
        try:
            planned = plan_from_costs(split, settings)
        except ValueError as error:
            first_error = first_error or error
            slowest.append(float("inf"))
            continue
        slowest.append(planned.slowest_stage_s)
        p = planned.partition
        key = (planned.slowest_stage_s, len(p.forward) + len(p.backward), shards)
        if best is None or key < best[0]:
            best = (key, shards, planned, split)
    if best is None:
        assert first_error is not None
        raise first_error
    _, shards, planned, split = best
    return SplitHeadPlan(num_head_shards=shards, planned=planned, costs=split, slowest_by_shards=tuple(slowest),
                         search_s=time.perf_counter() - started)


def head_shards_for(shape: DecoderShape, num_devices: int, num_microbatches: int, seq_len: int = 4096,
                    max_head_shards: int = 16) -> int:
    """The shard count `plan_split_head` picks for a model of `shape` from its FLOP costs alone (`head_shards="auto"`
    when a model is wrapped, before anything is measured): 1 on one device, where nothing runs beside the head."""
    if num_devices < 2:
        return 1
    forward = decoder_layer_flops(shape, seq_len)
    costs = LayerCosts(forward_s=forward, backward_s=[2 * f for f in forward])
    settings = PlanSettings(num_devices=num_devices, num_microbatches=num_microbatches,
                            gpu_memory_bytes=math.inf, pcie_bytes_per_s=math.inf)
    return plan_split_head(costs, settings, max_head_shards).num_head_shards


# The gain in the slowest stage below which a measured plan does not suggest splitting the head.
ADVISE_MIN_GAIN = 0.05


def measured_head_advice(costs: LayerCosts, settings: PlanSettings, max_head_shards: int = 16) -> str | None:
    """What to tell a user whose head is one layer when its measured `costs` say vocabulary shards would pace the
    ring better (several devices only): the shard count `plan_split_head` picks and the slowest stage with and
    without it; None when one head layer is as good (within `ADVISE_MIN_GAIN`) or nothing fits.

    The split is chosen when the model is wrapped (the layers are built then), so a measured choice can only be
    advice for the next run: `head_shards=K`, or "auto" for the count from the model's FLOPs."""
    if settings.num_devices < 2 or costs.num_layers < 2:
        return None
    try:
        split = plan_split_head(costs, settings, max_head_shards)
    except ValueError:
        return None
    whole, best = split.slowest_by_shards[0], split.slowest_by_shards[split.num_head_shards - 1]
    if split.num_head_shards == 1 or not best < whole * (1 - ADVISE_MIN_GAIN):
        return None
    layer = max(costs.forward_s[:-1]) or 1e-30
    return (f"the measured head costs {costs.forward_s[-1] / layer:.1f} decoder layers and, as one layer, paces the "
            f"ring: head_shards={split.num_head_shards} (env ROUNDPIPE_HEAD_SHARDS) would make the slowest stage "
            f"{whole * 1e3:.1f} -> {best * 1e3:.1f} ms")
