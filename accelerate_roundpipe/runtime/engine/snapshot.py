"""The engine's snapshot for telemetry (`telemetry/engine_view.py`): the one place that reads the engine's parts for
the start summary, so telemetry reads typed fields instead of the runtime's attributes by name."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ...config import RoundPipeConfig
from ...plan.first_pass_sizing import FirstPassSizing
from ...plan.partition import Partition
from ...telemetry.engine_view import (
    DataParallelView,
    DeviceView,
    EngineSnapshot,
    OptimizerView,
    PlacementView,
    StoreView,
)
from ..devices.device import Device
from ..disk import resident_memory_bytes
from ..distribution.gloo_exchange import DataParallelGroup
from ..execution.saved_input_room import SavedInputRoom
from ..optimizer.optimizer import RoundPipeOptimizer
from ..state.host_store import HostStore
from ..state.placement import OptimizerPlacement


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _store(store: HostStore) -> StoreView:
    buckets = store.buckets
    pool = store.saved_input_buffers
    return StoreView(
        estimated_bytes=store.estimated_bytes,
        compute_bytes=sum(b.compute.numel() * b.compute.element_size() for b in buckets),
        compute_dtypes=tuple(sorted({_dtype(b.compute) for b in buckets})),
        optimizer_dtypes=tuple(sorted({_dtype(b.optim) for b in buckets if b.optim is not None})),
        pinned=store.pin_memory,
        resident_bytes=resident_memory_bytes(),
        saved_input_pool_bytes=None if pool is None else pool.bytes,
        saved_input_pool_peak_bytes=None if pool is None else pool.peak_bytes)


def _optimizer(optimizer: RoundPipeOptimizer | None) -> OptimizerView | None:
    if optimizer is None:
        return None
    return OptimizerView(type(optimizer.inner).__name__, optimizer.async_step, optimizer.exact_steps_first)


def engine_snapshot(config: RoundPipeConfig, devices: Sequence[Device], layers: int, partition: Partition,
                    optimizer: RoundPipeOptimizer | None, placement: OptimizerPlacement | None,
                    group: DataParallelGroup | None, store: HostStore, notes: Mapping[str, str],
                    sizing: FirstPassSizing | None = None, saved_room: SavedInputRoom | None = None) -> EngineSnapshot:
    """The snapshot of an engine built of these parts, as they are now."""
    return EngineSnapshot(
        devices=tuple(DeviceView(str(d.device), d.is_cuda, d.tracks_memory) for d in devices),
        layers=layers,
        plan=config.resolved_plan,
        partition=str(partition),
        num_microbatches=config.num_microbatches,
        microbatches_per_round=config.microbatches_per_round,
        recompute=config.resolved_recompute,
        trace_path=config.trace_path,
        optimizer=_optimizer(optimizer),
        placement=None if placement is None else PlacementView(placement.summary(), placement.device_bytes(),
                                                               placement.tiers_line(), placement.disk_bytes,
                                                               placement.staging_bytes),
        data_parallel=None if group is None else DataParallelView(group.rank, group.world_size),
        store=_store(store),
        notes=tuple(notes.items()),
        first_pass=sizing,
        saved_input_lines=tuple(saved_room.lines) if saved_room is not None else (),
        saved_input_host_bytes=saved_room.most_host_bytes if saved_room is not None else 0)
