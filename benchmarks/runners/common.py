"""What the three ways in share, so that their tokens/s compare: the optimizer, the batch check, the result and how
an engine is closed."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import torch

from accelerate_roundpipe import RoundPipeConfig
from benchmarks.memory import PeakMeter
from benchmarks.timing import StepClock

ADAMW = dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)  # TrainingArguments' defaults


def check_batch(batch: dict, warm: int, iters: int) -> tuple[int, int]:
    """(rows, seq) of the batch; fails before any model is wrapped."""
    if iters < 1 or warm < 0:
        raise ValueError(f"need iters >= 1 and warm >= 0, got warm={warm} iters={iters}")
    rows, seq = batch["input_ids"].shape
    return rows, seq


def cuda_indices(config: RoundPipeConfig) -> list[int]:
    return sorted({d.index or 0 for d in config.resolved_devices() if d.type == "cuda"})


def config_values(config: RoundPipeConfig) -> dict[str, Any]:
    """The fields the caller set, as a `--roundpipe_*` argument takes them (lists comma-separated, dtypes by name)."""
    out = {}
    for f in dataclasses.fields(RoundPipeConfig):
        value = getattr(config, f.name)
        if value is None:
            continue
        if isinstance(value, (list, tuple)):
            value = ",".join(str(v) for v in value)
        elif isinstance(value, torch.dtype):
            value = str(value).removeprefix("torch.")
        out[f.name] = value
    return out


def fused_adamw(params, lr: float) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=lr, fused=True, **ADAMW)


def describe_optimizer(optimizer: torch.optim.Optimizer) -> str:
    """What steps the optimizer copies, e.g. 'AdamW(lr=1e-05, betas=(0.9, 0.999), eps=1e-08, weight_decay=0.0,
    fused=True) x 2 groups'."""
    group = optimizer.param_groups[0]
    keys = ("lr", "betas", "eps", "weight_decay", "fused")
    text = ", ".join(f"{k}={group.get(k)}" for k in keys)
    return f"{type(optimizer).__name__}({text}) x {len(optimizer.param_groups)} groups"


def placement_of(engine) -> dict | None:
    """Where the engine put each trainable bucket's optimizer state: the start summary's line, its counts, the
    setting and what the engine made of it (`placed_as`; see [Note: optimizer placement] in
    runtime/state/placement.py)."""
    placement = getattr(engine, "optimizer_placement", None)
    if placement is None:
        return None
    out = {"summary": placement.summary(), "device_buckets": len(placement.device_buckets),
           "host_buckets": len(placement.host_buckets), "device_gib": round(placement.device_bytes() / 2**30, 3),
           "setting": placement.setting, "placed": placed_as(placement)}
    disk = getattr(placement, "disk", None)
    if disk is not None:  # the disk tier ([Note: disk tier] in runtime/state/disk_tier.py)
        out["disk"] = {"buckets": len(placement.disk_buckets), "gib": round(placement.disk_bytes / 2**30, 3),
                       "host_budget_gib": round(placement.host_budget_bytes / 2**30, 3), "folder": disk.folder,
                       "tiers": placement.tiers_line(), **disk_bandwidth_of(disk.bandwidth),
                       "implied_step_s": disk.step_seconds and round(disk.step_seconds, 3)}
    return out


def saved_inputs_of(engine) -> dict:
    """What the engine said of the layer inputs its passes keep for recomputation, from its snapshot: the lines
    (each with the process's resident memory then) and the most host bytes of them
    ([Note: saved inputs in the start summary]); with the store's pool on, its blocks now and at most."""
    snapshot = engine.snapshot()
    record = {"lines": list(snapshot.saved_input_lines), "most_host_bytes": snapshot.saved_input_host_bytes}
    if snapshot.store.saved_input_pool_bytes is not None:  # [Note: saved inputs in pooled blocks]
        record["pool_bytes"] = snapshot.store.saved_input_pool_bytes
        record["pool_peak_bytes"] = snapshot.store.saved_input_pool_peak_bytes
    return record


def disk_bandwidth_of(bandwidth) -> dict:
    """A `DiskBandwidth` (the disk's probe: runtime/disk/bandwidth.py) as record fields."""
    if bandwidth is None:
        return {}
    return {"disk_write_gbps": round(bandwidth.write_gbps, 3), "disk_read_gbps": round(bandwidth.read_gbps, 3),
            "disk_probe_bytes": bandwidth.nbytes, "disk_folder": bandwidth.folder}


def placed_as(placement) -> str:
    """Where the engine's `OptimizerPlacement` put the optimizer state, in the setting's words: "host" when every
    trainable bucket stayed on the host, whatever the setting (host; auto with CPU workers or under data
    parallelism; nothing that fit the device budget), else the setting. Read from the engine, not re-derived from
    the config: the engine's rules (placement.py) are the only ones."""
    if getattr(placement, "disk_buckets", None):
        return f"{placement.setting}+disk" if placement.device_buckets else "disk"
    return placement.setting if placement.device_buckets else "host"


def is_bf16(model: torch.nn.Module) -> bool:
    return any(p.dtype == torch.bfloat16 for p in model.parameters())


def run_result(clock: StepClock, losses: list[float], rows: int, seq: int, microbatches: int, meter: PeakMeter,
               path: dict) -> dict:
    """{"iter_s": seconds per timed step, "tokens_per_s": rows*seq / iter_s, "losses": every step's loss, "step_s":
    every step's unsynchronized wall time, "num_microbatches": per step, "gpu_peak_gib", "host_peak_gib", "path": the
    way in and its settings}."""
    iter_s = clock.iter_s()
    return {"iter_s": round(iter_s, 6), "tokens_per_s": round(rows * seq / iter_s, 1), "losses": losses,
            "step_s": clock.step_s, "num_microbatches": microbatches, **meter.read(), "path": path}


def close_engine(engine) -> None:
    if engine is not None:
        try:
            engine.close()
        except Exception as error:  # noqa: BLE001 -- a failed run's engine may not close cleanly; keep its error
            print(f"[bench] engine.close() failed: {error!r}", file=sys.stderr, flush=True)


def reset_accelerate_state() -> None:
    """Each run starts like a fresh process (accelerate keeps process-wide singletons)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
