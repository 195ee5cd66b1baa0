"""The measured plan: measure the first training pass, re-plan from it, and decide what saved inputs may stay.

[Note: measured plan]
With `plan="measured"` the first training pass carries a `LayerProfile`; at the start of the next pass, once the
measured pass has finished (its CUDA events are read then, once), the partition is chosen from the measured costs:
one device takes `plan_one_device` (no recomputation where memory allows, and, when `num_microbatches` is unset, the
fewest micro-batches for which the whole model fits), several take `plan_from_costs` (the slowest stage as fast as
memory allows). The planner works with `PLAN_SHARE` of the budget (the CUDA context, allocator slack and transfers
in flight take the rest). Its transfer times use the upload rate measured over that pass's weight uploads
(`PCIE_BYTES_PER_S`, assumed, only when none could be timed). When `num_microbatches` is unset, the count is then
weighed against the transfers: that count and the smaller ones are planned and their passes predicted (the larger
ones when none of those fits), and the shortest is kept ([Note: micro-batches chosen for transfers]). The start
summary's `transfers:` line, printed after the re-plan, says whether the plan is transfer-bound and which batch would
hide its uploads ([Note: transfers sized to the batch]). If no plan fits, the partition that just ran is kept.

[Note: saved inputs]
The layer inputs a forward stage keeps for the backward's recomputation stay on the device when the task that reads
them runs on the same worker and the device's allocated memory stays under `keep_limit_bytes`: with the measured
plan, what the largest planned stage leaves of the budget (nothing during the measured pass itself, whose unplanned
stages could otherwise run out of memory under a tight budget); with a static plan, `SAVED_INPUT_SHARE` of the
budget. The rest takes the host round trip (download now, upload in the backward). On one GPU with room this removes
the largest PCIe traffic after the weights; nothing changes in the maths.

[Note: limits in allocated bytes]
The planner sizes stages in the budget the placed optimizer state leaves (`place_optimizer_state` subtracts it), so
`keep_limit_bytes` and `lookahead_limit_bytes` are room beside that state. A worker compares its limit with the
device's allocated memory, which holds the state too, so a pass's plan carries each room plus the state placed on
the device (`allocated_limit`). Before this, a 4B full fine-tune under a 24 GiB cap (11 GiB of state on the card,
a 2.7 GiB look-ahead room) could never keep a saved input or take a look-ahead, while the same model with its state
on the host could. `COUNT_PLACED_STATE = False` is the behaviour before (benchmarks/run.py
`--limits-without-placed-state`).
"""

from __future__ import annotations

import logging

from ...config import RoundPipeConfig
from ...plan.head_split import measured_head_advice
from ...plan.layer_costs import LayerCosts
from ...plan.microbatch_choice import TransferPlan, choose_microbatches, fewer_microbatches
from ...plan.partition import Partition
from ...plan.stage_cost_model import PlanSettings
from ...plan.transfer_budget import TransferBudget
from ...telemetry.summary import announce, replanned_line, transfers_line
from ..common.sync import FailureFlag
from ..devices.device import Device
from ..devices.pinned import release_cached_pinned_memory
from ..state.host_store import HostStore
from ..state.placement import (
    OptimizerPlacement,
    lock_host_optimizer_copies,
    place_optimizer_state,
    place_past_host_budget,
)
from .layer_profile import LayerProfile

logger = logging.getLogger(__name__)

SAVED_INPUT_SHARE = 0.25  # of the memory budget, for saved inputs kept on the device under a static plan
PLAN_SHARE = 0.8  # of the memory budget, for the stages the planner sizes
COUNT_PLACED_STATE = True  # [Note: limits in allocated bytes]
PCIE_BYTES_PER_S = 25e9  # per direction, a conservative PCIe 4/5 x16 figure, when no upload could be timed
MICROBATCH_CHOICES = (1, 2, 4, 8, 16, 32)


def memory_budget_bytes(config: RoundPipeConfig, devices: list[Device]) -> float | None:
    """`gpu_memory_budget`, else the smallest GPU's memory; None for CPU workers only."""
    budget_gib = config.gpu_memory_budget
    limits = [size for size in (d.total_memory_bytes() for d in devices) if size is not None]
    if budget_gib is None and limits:
        budget_gib = min(limits) / 2**30
    return None if budget_gib is None else budget_gib * 2**30


class MeasuredPlan:
    """The engine's planning state across passes (see the notes above)."""

    def __init__(self, config: RoundPipeConfig, devices: list[Device], store: HostStore) -> None:
        self.config, self.devices, self.store = config, devices, store
        self.enabled = config.resolved_plan == "measured"
        self.budget_bytes = memory_budget_bytes(config, devices)
        self.keep_limit_bytes = 0 if self.enabled else self._static_keep_limit()
        # A third task's parameters may be prefetched while the device's allocated memory stays under this
        # ([Note: shared frozen weights]); 0 until a measured plan says what a running task may still allocate.
        self.lookahead_limit_bytes = 0
        self.device_state_bytes = 0  # the optimizer state placed on the device holding the most
        # The host's optimizer copies, gradients and states once all allocated (the placement's), None before an
        # optimizer is wrapped ([Note: first-pass backward stages])
        self.host_state_bytes: int | None = None
        self.layer_costs: LayerCosts | None = None
        self.chosen_microbatches: int | None = None  # when num_microbatches is unset
        self.head_advice: str | None = None  # vocabulary shards the measured costs suggest (several devices)
        self.transfer_plan: TransferPlan | None = None  # the re-plan's count, stages and transfer verdict
        self._measure_next = self.enabled
        self._measured: tuple[LayerProfile, list, int, int] | None = None

    def _static_keep_limit(self) -> int:
        """What saved inputs may keep on the device under a static plan ([Note: saved inputs])."""
        return int((self.budget_bytes or 0) * SAVED_INPUT_SHARE)

    def place_optimizer_state(self, optimizer, data_parallel: bool) -> OptimizerPlacement:
        """Place the optimizer state of `optimizer` (being wrapped) and plan the stages in the memory it leaves
        ([Note: optimizer placement])."""
        config = self.config
        placement = place_optimizer_state(config.resolved_optimizer_placement, config.optimizer_device_budget,
                                          self.devices, self.store, optimizer, data_parallel, self.budget_bytes)
        placement = place_past_host_budget(placement, self.store, optimizer, data_parallel,
                                           config.host_memory_budget, config.resolved_offload_dir,
                                           config.resolved_wait_timeout_s,  # [Note: disk tier]
                                           budget_given=config.setting_as_given("host_memory_budget")
                                           if config.host_memory_budget is not None else None)
        self.host_state_bytes = placement.host_state_bytes
        lock_host_optimizer_copies(self.store)
        self.store.lock_crossing_compute_copies()  # [Note: compute copies locked where they cross]
        if self.budget_bytes is not None and placement.device_buckets:
            self.device_state_bytes = placement.most_on_one_device()
            self.budget_bytes -= self.device_state_bytes
            if not self.enabled:
                self.keep_limit_bytes = self._static_keep_limit()
        return placement

    def allocated_limit(self, room_bytes: int) -> int:
        """The device's allocated memory a pass may reach for a room of `room_bytes` beside the placed optimizer
        state (0 stays 0: never) ([Note: limits in allocated bytes])."""
        if room_bytes <= 0 or not COUNT_PLACED_STATE:
            return room_bytes
        return room_bytes + self.device_state_bytes

    def profile_for_pass(self, num_layers: int) -> LayerProfile | None:
        """A profile for the training pass about to be queued, if it is the one to measure."""
        if not self._measure_next:
            return None
        self._measure_next = False
        return LayerProfile(num_layers)

    def measured(self, profile: LayerProfile, jobs: list, num_mb: int, rows: int) -> None:
        self._measured = (profile, jobs, num_mb, rows)

    def replan(self, current: Partition, failure: FailureFlag) -> Partition:
        """The partition for the next pass: re-planned once the measured pass has finished, else `current`."""
        if self._measured is None:
            return current
        profile, jobs, num_mb, rows = self._measured
        self._measured = None
        for job in jobs:
            job.done.get(failure)
        self.layer_costs = profile.layer_costs(self.store)
        rate = profile.upload_bytes_per_s()
        transfers = TransferBudget(self.layer_costs, rows / num_mb, rate or PCIE_BYTES_PER_S,
                                   "measured" if rate else "assumed")
        budget = self.budget_bytes
        if budget is None:  # CPU workers: no memory limit to plan against
            budget = float(sum(self.layer_costs.param_bytes) * 4 + sum(self.layer_costs.act_bytes) * num_mb + 1)
        try:
            self.transfer_plan = self._plan(transfers, budget, num_mb, rows)
        except ValueError as error:
            logger.warning("RoundPipe kept the partition %s: no plan from the measured costs fits (%s).", current,
                           error)
            return current
        planned, chosen = self.transfer_plan.planned, self.transfer_plan.num_microbatches
        if planned.partition != current or chosen != num_mb:  # other saved inputs from now on
            release_cached_pinned_memory()  # [Note: the measured pass's pinned blocks released]
            if self.store.saved_input_buffers is not None:  # and ours ([Note: saved inputs in pooled blocks])
                self.store.saved_input_buffers.release_idle()
        announce(replanned_line(planned.partition) + "\n" + transfers_line(self.transfer_plan),
                 self.config.resolved_summary)
        if chosen != num_mb:
            logger.info("RoundPipe runs %d micro-batches per batch from now on (measured plan; set num_microbatches "
                        "to choose).", chosen)
            self.chosen_microbatches = chosen
        if self.budget_bytes is not None:  # GPUs: saved inputs only in what the plan leaves free
            self.keep_limit_bytes = max(0, int(budget * PLAN_SHARE - planned.peak_stage_bytes))
        self.lookahead_limit_bytes = max(0, int(budget * PLAN_SHARE - planned.peak_working_bytes))
        logger.info("RoundPipe re-planned from measured costs: %s (was %s).", planned.partition, current)
        return planned.partition

    def _advise_head_split(self, costs: LayerCosts, settings: PlanSettings) -> None:
        """Log the vocabulary shards the measured costs would choose for a head that is one layer and could be cut
        (its `vocabulary_split_problem()` is None): the split is fixed once the model is wrapped."""
        head = self.store.layers[-1]
        problem = getattr(head, "vocabulary_split_problem", None)
        if problem is None or problem() is not None:
            return
        advice = measured_head_advice(costs, settings)
        if advice is not None:
            logger.warning("RoundPipe: %s.", advice)
            self.head_advice = advice

    def _plan(self, transfers: TransferBudget, budget: float, num_mb: int, rows: int) -> TransferPlan:
        """The micro-batch count, partition and transfer verdict for the measured pass of `num_mb` micro-batches
        of a `rows`-row batch (`transfers`: its costs and upload rate).

        The count: `num_microbatches` when set; else, on one device, first the fewest micro-batches (larger ones
        keep the GPU busier per kernel and per Python call; an H200 ran Qwen3-1.7B 11% faster with 1 than with 2)
        for which the whole model fits the fused stage, activation bytes scaled with the micro-batch size (if none
        does, the measured count); on several devices the measured count. Then that count and the smaller ones
        are weighed with their transfers and the fastest predicted pass is kept
        ([Note: micro-batches chosen for transfers]).

        [Note: more micro-batches when the measured ones do not fit]
        The first pass runs a count chosen before anything was measured (2 per device), and the optimizer state
        placed on the device may leave too little for it once planned: Qwen3-30B-A3B's LoRA on the experts under a
        24 GiB cap (12 GiB of optimizer state on the card) measured 2 micro-batches of 4 rows whose layer needed
        9.9 GiB against 9.6 GiB left, and kept running the unplanned first partition. When no count up to the
        measured one fits, the larger counts (smaller micro-batches, less activation memory; with one round the
        same uploads) are planned and the fastest predicted one that fits is kept."""
        config = self.config
        num_devices = len(self.devices)

        def choose(candidates: list[int]) -> TransferPlan:
            return choose_microbatches(transfers, rows, num_devices, candidates, budget * PLAN_SHARE,
                                       config.microbatches_per_round, config.resolved_recompute)

        if num_devices > 1:
            per_task = min(config.microbatches_per_round or num_mb, num_mb)
            self._advise_head_split(transfers.costs, PlanSettings(
                num_devices=num_devices, num_microbatches=per_task, gpu_memory_bytes=budget * PLAN_SHARE,
                pcie_bytes_per_s=transfers.bytes_per_s, recompute=config.resolved_recompute))
        if config.num_microbatches is not None:
            return choose([num_mb])
        count = num_mb
        if num_devices == 1:
            for candidate in sorted({c for c in MICROBATCH_CHOICES if c <= rows} | {num_mb}):
                try:
                    if choose([candidate]).planned.partition.forward == ():
                        count = candidate
                        break
                except ValueError:
                    continue
        try:
            return choose(fewer_microbatches(count, rows, MICROBATCH_CHOICES))
        except ValueError:
            more = sorted(c for c in {*MICROBATCH_CHOICES, rows} if count < c <= rows)
            if not more:
                raise
            # see [Note: more micro-batches when the measured ones do not fit] above
            plan = choose(more)
            logger.info("RoundPipe: the measured %d micro-batches do not fit the memory the optimizer state "
                        "leaves; %d do.", count, plan.num_microbatches)
            return plan
