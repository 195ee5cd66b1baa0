"""The engine's start summary: one block on stderr, when the first pass starts, saying that RoundPipe is on and how
it will run (devices, plan, micro-batches, recompute, optimizer, clipping, host memory, trace); with the measured
plan, one `transfers:` line follows the re-plan (`transfers_line`).

Printed to stderr rather than logged: Hugging Face scripts leave Python logging at WARNING (transformers' own
verbosity is "warning" by default, and `run_clm`-style scripts configure the root logger without lowering it), so an
`info` line would not reach the users it is for, and a warning would cry wolf. `ROUNDPIPE_SUMMARY=0` (or
`summary=False`) turns it off, together with the "trace written to" lines.

The summary is printed from the engine's snapshot (`telemetry/engine_view.py`, `RoundPipe.snapshot()`), never from
the engine itself: telemetry sits below the runtime and imports nothing from it.
"""

from __future__ import annotations

import sys

from ..plan.microbatch_choice import TransferPlan
from ..plan.partition import Partition
from .engine_view import EngineSnapshot, OptimizerView, PlacementView, StoreView

PREFIX = "[roundpipe] "


def announce(text: str, enabled: bool = True) -> None:
    """Print `text` to stderr, every line prefixed, when `enabled` (the engine's `summary` setting)."""
    if enabled:
        print("\n".join(PREFIX + line for line in text.splitlines()), file=sys.stderr, flush=True)


def _microbatches(snapshot: EngineSnapshot) -> str:
    num_devices = len(snapshot.devices)
    sizing = snapshot.first_pass
    if snapshot.num_microbatches is not None:
        count = f"{snapshot.num_microbatches} per pass (num_microbatches)"
    elif sizing is not None and sizing.raised and snapshot.plan == "measured":
        count = (f"{sizing.count} per pass on the first pass ({sizing.reason()}), then the measured plan's choice "
                 f"(num_microbatches to fix it)")
    elif sizing is not None and sizing.raised:  # [Note: first-pass micro-batches], for every pass of a static plan
        count = (f"{sizing.count} per pass for {sizing.rows} rows of {sizing.seq_len} tokens ({sizing.reason()}; "
                 f"num_microbatches to change it)")
    elif snapshot.plan == "measured":
        count = (
            f"{2 * num_devices} per pass (2 x devices) on the first pass, then the measured plan's choice "
            f"(num_microbatches to fix it)"
        )
    else:
        count = f"{2 * num_devices} per pass (2 x devices; num_microbatches to change it), at most one per row"
    rounds = (
        f"{snapshot.microbatches_per_round} per round"
        if snapshot.microbatches_per_round is not None
        else "all in one round"
    )
    stages = sizing.stages_reason(snapshot.layers) if sizing is not None else None  # [Note: first-pass backward stages]
    return f"{count}, {rounds}" + (f"; {stages}" if stages else "")


def replanned_line(partition: Partition) -> str:
    """The summary's second `plan:` line, printed at the measured plan's re-plan: the partition every later pass runs
    (the start summary shows the first pass's, which the re-plan replaces)."""
    return f"  plan: measured from the first pass, {partition}"


def transfers_line(transfer_plan: TransferPlan) -> str:
    """The summary's `transfers:` line, printed after the measured plan's re-plan (the first pass measured what
    it says): whether the plan is transfer-bound, and which batch would hide its uploads
    ([Note: transfers sized to the batch] in `plan/transfer_budget.py`)."""
    return f"  transfers: {transfer_plan.summary()}"


def _optimizer(optimizer: OptimizerView | None) -> str:
    if optimizer is None:
        return "none wrapped yet (engine.wrap_optimizer or accelerator.prepare)"
    if not optimizer.lagged:
        return f"{optimizer.name}, exact step (sync; async_optimizer=true for the lagged one)"
    warmup = f", the first {optimizer.exact_steps_first} exact" if optimizer.exact_steps_first else ""
    return f"{optimizer.name}, lagged one step (async, staleness 1{warmup})"


def _dtypes(store: StoreView) -> str:
    return f"compute {'/'.join(store.compute_dtypes)}, optimizer {'/'.join(store.optimizer_dtypes) or '-'}"


def summary_size(num_bytes: float) -> str:
    """Bytes as the start summary's lines give them (the tiers' line and the placement's messages too)."""
    return f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.1f} MiB"



def _off_host(placement: PlacementView | None) -> int:
    """Bytes of optimizer state the placement keeps on devices or on disk, not in host memory
    ([Note: optimizer placement])."""
    return placement.device_bytes + placement.disk_bytes if placement is not None else 0


def _host_bytes(store: StoreView, placement: PlacementView | None) -> int:
    """The store's estimate, less what the placement keeps on devices or on disk (never below the compute copies),
    plus the disk tier's staging slots, which live in host memory."""
    staging = placement.staging_bytes if placement is not None else 0
    return max(store.estimated_bytes - _off_host(placement), store.compute_bytes) + staging


def _host_parts(placement: PlacementView | None) -> str:
    if not _off_host(placement):
        return ""
    staging = f" and {summary_size(placement.staging_bytes)} of disk staging slots" if placement.staging_bytes \
        else ""
    return f" of the buckets on the host{staging}"


def _beside_the_store(placement: PlacementView | None) -> str:
    """Where a host budget sized the tiers ([Note: disk tier]): what the budget does not bound. A Llama-3.1-8B run
    with `host_memory_budget=96` peaked at 110.6 GiB resident against 93.1 GiB counted for the store."""
    if placement is None or not placement.disk_bytes:
        return ""
    return ("; beside it, outside host_memory_budget: the layer inputs kept for recomputation (they grow with the "
            "rows of a call) and the process's own memory")


def _resident(store: StoreView) -> str:
    """The process's resident memory as the summary is printed, before the first pass: beside the store's count, what
    the libraries, the CUDA context and what the caller holds add (the `saved inputs:` line says what a pass adds)."""
    if store.resident_bytes is None:
        return ""
    return f"; this process is resident at {summary_size(store.resident_bytes)} now"


def engine_summary(snapshot: EngineSnapshot) -> str:
    """The start summary of an engine, from its snapshot, as lines of text (see the module docstring)."""
    store, placement, group = snapshot.store, snapshot.placement, snapshot.data_parallel
    devices = ", ".join(d.name for d in snapshot.devices)
    # The summary is printed before the first pass: the partition it shows is that pass's, and the re-plan prints
    # the one the later passes run (`replanned_line`).
    replan = " for the first pass; re-planned from its measured costs (the next `plan:` line)" \
        if snapshot.plan == "measured" else ""
    lines = [
        f"RoundPipe is on: {len(snapshot.devices)} worker(s) ({devices}), {snapshot.layers} pipeline layers",
        f"  plan: {snapshot.plan}, {snapshot.partition}{replan}",
        f"  micro-batches: {_microbatches(snapshot)}; recompute: {snapshot.recompute}",
        f"  optimizer: {_optimizer(snapshot.optimizer)}",
    ]
    if placement is not None:  # [Note: optimizer placement]
        lines.append(f"  optimizer state: {placement.summary}")
        if placement.disk_bytes:  # [Note: disk tier]
            lines.append(f"  tiers: {placement.tiers}")
    if group is not None:
        lines.append(f"  data parallel: rank {group.rank} of {group.world_size} (gradients reduce-scattered, optimizer "
                     f"state sharded, weights all-gathered per bucket; gloo)")
    lines += [f"  {name}: {value}" for name, value in snapshot.notes]
    lines += [
        f"  host memory: about {summary_size(_host_bytes(store, placement))} for the store ({_dtypes(store)}, "
        f"with AdamW state{_host_parts(placement)}), "
        f"pinned: {'yes' if store.pinned else 'no'}{_beside_the_store(placement)}{_resident(store)}",
        f"  trace: {snapshot.trace_path} (written at the end of training and at exit)"
        if snapshot.trace_path
        else "  trace: off (ROUNDPIPE_TRACE=path.json records one)",
        "  (ROUNDPIPE_SUMMARY=0 hides this summary)",
    ]
    return "\n".join(lines)
