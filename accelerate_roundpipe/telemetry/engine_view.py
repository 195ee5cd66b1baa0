"""What telemetry knows of an engine: `EngineSnapshot`, frozen plain data the runtime hands it
(`RoundPipe.snapshot()`, built in `runtime/engine/snapshot.py`).

Telemetry sits below the runtime and imports nothing from it; it used to read the engine duck-typed by attribute
names (and reach into its optimizer and host store), so a rename in the runtime broke the start summary only when
it printed. The snapshot names every fact it reads as a typed field, the runtime fills them in one place, and a
snapshot cannot change behind the text printed from it. What changes while the engine runs (the token counts, the
trace, the devices' memory peaks) is not copied here: `MetricsWindow` reads it live (`telemetry/metrics.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..plan.first_pass_sizing import FirstPassSizing


@dataclass(frozen=True)
class DeviceView:
    name: str  # the torch device, as printed: "cpu", "cuda:0"
    is_cuda: bool
    tracks_memory: bool  # it counts its allocated memory (the metrics' GPU peak)


@dataclass(frozen=True)
class OptimizerView:
    name: str  # the wrapped optimizer's class, e.g. "AdamW"
    lagged: bool  # async_optimizer: the step applies one pass late
    exact_steps_first: int  # the lagged step's warm-up: this many exact steps first


@dataclass(frozen=True)
class PlacementView:
    """Where the trainable buckets' optimizer state lives ([Note: optimizer placement])."""

    summary: str  # its line of the start summary
    device_bytes: int  # bytes kept on devices, not in host memory
    tiers: str = ""  # buckets and GiB per tier, the disk's bandwidth ([Note: disk tier]); its line of the summary
    disk_bytes: int = 0  # bytes kept in swap files, not in host memory
    staging_bytes: int = 0  # the disk tier's page-locked staging slots, in host memory ([Note: disk tier])


@dataclass(frozen=True)
class DataParallelView:
    rank: int
    world_size: int


@dataclass(frozen=True)
class StoreView:
    """The host store, in numbers."""

    estimated_bytes: int  # compute and optimizer copies, gradients and optimizer state, placed or not
    compute_bytes: int  # the compute copies alone (never leave host memory)
    compute_dtypes: tuple[str, ...]  # sorted, without "torch."
    optimizer_dtypes: tuple[str, ...]  # of the buckets with an optimizer copy; () when none has one
    pinned: bool
    resident_bytes: int | None = None  # the process's resident memory when the snapshot was taken; None: unknown
    # the store's page-locked blocks for saved layer inputs (held and free) and the most at once; None: pool off
    # ([Note: saved inputs in pooled blocks])
    saved_input_pool_bytes: int | None = None
    saved_input_pool_peak_bytes: int | None = None


@dataclass(frozen=True)
class EngineSnapshot:
    devices: tuple[DeviceView, ...]
    layers: int  # pipeline layers
    plan: str  # the resolved plan: "static" or "measured"
    partition: str  # the stages the next pass runs, as printed
    num_microbatches: int | None  # as set; None: the engine's choice
    microbatches_per_round: int | None
    recompute: str  # the resolved setting
    trace_path: str | None  # None: no trace is recorded
    optimizer: OptimizerView | None  # None until one is wrapped
    placement: PlacementView | None  # None until an optimizer is wrapped
    data_parallel: DataParallelView | None  # None on one process
    store: StoreView
    notes: tuple[tuple[str, str], ...] = ()  # (name, text) lines the integrations add (e.g. "clipping")
    first_pass: FirstPassSizing | None = None  # the unplanned count's sizing ([Note: first-pass micro-batches])
    # the `saved inputs:` lines said so far, and the most host bytes (as allocated) of them
    # ([Note: saved inputs in the start summary])
    saved_input_lines: tuple[str, ...] = ()
    saved_input_host_bytes: int = 0
