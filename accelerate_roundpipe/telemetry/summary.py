"""The engine's start summary: one block on stderr, when the first pass starts, saying that RoundPipe is on and how
it will run (devices, plan, micro-batches, recompute, optimizer, clipping, host memory, trace); with the measured
plan, one `transfers:` line follows the re-plan (`transfers_line`).

Printed to stderr rather than logged: Hugging Face scripts leave Python logging at WARNING (transformers' own
verbosity is "warning" by default, and `run_clm`-style scripts configure the root logger without lowering it), so an
`info` line would not reach the users it is for, and a warning would cry wolf. `ROUNDPIPE_SUMMARY=0` (or
`summary=False`) turns it off, together with the "trace written to" lines.

The engine is read duck-typed (`devices`, `layers`, `partition`, `config`, `optimizer`, `host_store`,
`summary_notes`): telemetry sits below the runtime and imports nothing from it.
"""

from __future__ import annotations

import sys

PREFIX = "[roundpipe] "


def announce(text: str, enabled: bool = True) -> None:
    """Print `text` to stderr, every line prefixed, when `enabled` (the engine's `summary` setting)."""
    if enabled:
        print("\n".join(PREFIX + line for line in text.splitlines()), file=sys.stderr, flush=True)


def _microbatches(config, num_devices: int) -> str:
    if config.num_microbatches is not None:
        count = f"{config.num_microbatches} per pass (num_microbatches)"
    elif config.resolved_plan == "measured":
        count = (
            f"{2 * num_devices} per pass (2 x devices) on the first pass, then the measured plan's choice "
            f"(num_microbatches to fix it)"
        )
    else:
        count = f"{2 * num_devices} per pass (2 x devices; num_microbatches to change it), at most one per row"
    rounds = (
        f"{config.microbatches_per_round} per round"
        if config.microbatches_per_round is not None
        else "all in one round"
    )
    return f"{count}, {rounds}"


def transfers_line(transfer_plan) -> str:
    """The summary's `transfers:` line, printed after the measured plan's re-plan (the first pass measured what
    it says): whether the plan is transfer-bound, and which batch would hide its uploads
    ([Note: transfers sized to the batch] in `plan/transfer_budget.py`; `transfer_plan` is a
    `plan.microbatch_choice.TransferPlan`)."""
    return f"  transfers: {transfer_plan.summary()}"


def _optimizer(engine) -> str:
    optimizer = engine.optimizer
    if optimizer is None:
        return "none wrapped yet (engine.wrap_optimizer or accelerator.prepare)"
    name = type(optimizer.inner).__name__
    if not optimizer.async_step:
        return f"{name}, exact step (sync; async_optimizer=true for the lagged one)"
    warmup = f", the first {optimizer.exact_steps_first} exact" if optimizer.exact_steps_first else ""
    return f"{name}, lagged one step (async, staleness 1{warmup})"


def _dtypes(store) -> str:
    compute = sorted({str(b.compute.dtype).removeprefix("torch.") for b in store.buckets})
    optim = sorted({str(b.optim.dtype).removeprefix("torch.") for b in store.buckets if b.optim is not None})
    return f"compute {'/'.join(compute)}, optimizer {'/'.join(optim) or '-'}"


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.1f} MiB"


def _on_device(placement) -> int:
    """Bytes of optimizer state the placement keeps on devices, not in host memory ([Note: optimizer placement])."""
    return placement.device_bytes() if placement is not None else 0


def _host_bytes(store, placement) -> int:
    """The store's estimate, less what the placement keeps on devices; never below the compute copies."""
    compute = sum(b.compute.numel() * b.compute.element_size() for b in store.buckets)
    return max(store.estimated_bytes - _on_device(placement), compute)


def engine_summary(engine) -> str:
    """The start summary of `engine`, as lines of text (see the module docstring)."""
    config, store = engine.config, engine.host_store
    devices = ", ".join(str(d.device) for d in engine.devices)
    plan = config.resolved_plan
    replan = " (re-planned from the first pass's measured costs)" if plan == "measured" else ""
    lines = [
        f"RoundPipe is on: {len(engine.devices)} worker(s) ({devices}), {len(engine.layers)} pipeline layers",
        f"  plan: {plan}, {engine.partition}{replan}",
        f"  micro-batches: {_microbatches(config, len(engine.devices))}; recompute: {config.resolved_recompute}",
        f"  optimizer: {_optimizer(engine)}",
    ]
    placement = getattr(engine, "optimizer_placement", None)  # [Note: optimizer placement]
    if placement is not None:
        lines.append(f"  optimizer state: {placement.summary()}")
    group = getattr(engine, "data_parallel", None)
    if group is not None:
        lines.append(f"  data parallel: rank {group.rank} of {group.world_size} (gradients reduce-scattered, optimizer "
                     f"state sharded, weights all-gathered per bucket; gloo)")
    lines += [f"  {name}: {value}" for name, value in engine.summary_notes.items()]
    lines += [
        f"  host memory: about {_size(_host_bytes(store, placement))} for the store ({_dtypes(store)}, "
        f"with AdamW state{' of the buckets on the host' if _on_device(placement) else ''}), "
        f"pinned: {'yes' if store.pin_memory else 'no'}",
        f"  trace: {config.trace_path} (written at the end of training and at exit)"
        if config.trace_path
        else "  trace: off (ROUNDPIPE_TRACE=path.json records one)",
        "  (ROUNDPIPE_SUMMARY=0 hides this summary)",
    ]
    return "\n".join(lines)
