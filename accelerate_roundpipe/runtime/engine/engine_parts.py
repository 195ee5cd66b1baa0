"""The engine's collaborators, each built with what it needs, in the order they depend on each other: the engine
(`RoundPipe`) takes them whole and wires nothing afterwards. The one exception is what only exists later: the
optimizer, wrapped at `wrap_optimizer`, which the engine hands to its owners through named methods
(`EngineThreads.use_optimizer`, `TornGuard.follow_optimizer`)."""

from __future__ import annotations

import gc
import logging
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...config import RoundPipeConfig
from ...plan.partition import plan_partition
from ...telemetry.trace import TraceRecorder
from ..common.sync import FailureFlag
from ..devices.device import Device, use_expandable_segments
from ..devices.factory import make_device
from ..devices.pinned import unrounded_pinned_cache_hazard
from ..distribution.gloo_exchange import DataParallelGroup
from ..distribution.gradient_exchange import NoExchange, gradient_exchange
from ..execution.adapter_switches import AdapterSwitches
from ..execution.deferred import DeferredPasses
from ..execution.dispatch import Dispatcher
from ..execution.first_pass import FirstPassSizer
from ..execution.layer_buffers import LayerBuffers
from ..execution.measured_plan import MeasuredPlan
from ..execution.microbatches import MicrobatchPolicy
from ..execution.saved_input_room import SavedInputRoom
from ..state.host_store import HostStore
from ..state.torn import TornGuard
from .engine_checkpoint import PassCounts
from .engine_threads import EngineThreads
from .pass_launch import PassLauncher

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class EngineParts:
    devices: list[Device]
    exchange: NoExchange | DataParallelGroup  # [Note: gradient exchange]
    store: HostStore
    failure: FailureFlag
    passes: PassCounts  # the RNG streams' base seed and keys ([Note: RNG streams of passes])
    trace: TraceRecorder | None
    plan: MeasuredPlan
    microbatches: MicrobatchPolicy
    dispatch: Dispatcher
    deferred: DeferredPasses
    threads: EngineThreads
    torn: TornGuard
    launch: PassLauncher


COLLECT_ABOVE_BYTES = 2**30  # earlier engines' host stores this large are collected before a new one is built
_stores: weakref.WeakSet[HostStore] = weakref.WeakSet()  # every engine's store while it lives


def _open_stores() -> list[HostStore]:
    return [store for store in list(_stores) if not store.released]


def collect_earlier_engines() -> None:
    """Before a new engine allocates its host store: collect the earlier engines that are garbage (a notebook's
    or a sweep's previous Trainer, dropped but still referred to by its own cycles), so that their memory is back
    first ([Note: memory freed at close]); then warn of those still open. Only when they hold enough to matter:
    a full collection takes a moment in a large process."""
    if sum(store.estimated_bytes for store in _open_stores()) < COLLECT_ABOVE_BYTES:
        return
    gc.collect()
    held = _open_stores()
    if held:
        logger.warning(
            "%d earlier RoundPipe engine(s) in this process are still open, holding about %.1f GiB of host memory "
            "(weights, optimizer state, gradients). If they are from an earlier run (a notebook cell run again, a "
            "sweep), close them (engine.close(); a Trainer's trainer.roundpipe_engine.close()) or drop every "
            "reference to them to free it; engines meant to run together (a TRL reference model) need nothing.",
            len(held), sum(store.estimated_bytes for store in held) / 2**30)


def build_engine_parts(module: nn.Module, pipeline: nn.Sequential, config: RoundPipeConfig,
                       allow_short_batches: bool) -> EngineParts:
    devices = [make_device(d, i) for i, d in enumerate(config.resolved_devices())]
    uses_cuda = any(d.is_cuda for d in devices)
    if uses_cuda and use_expandable_segments():
        logger.info("RoundPipe turned on the CUDA allocator's expandable segments (set PYTORCH_CUDA_ALLOC_CONF "
                    "to choose the allocator settings yourself).")
    hazard = unrounded_pinned_cache_hazard() if uses_cuda else None
    if hazard is not None:  # [Note: unrounded page-locked blocks]
        logger.warning("RoundPipe: %s", hazard)
    pin = config.pin_memory if config.pin_memory is not None else uses_cuda
    if pin and not torch.cuda.is_available():
        raise ValueError("pin_memory (env ROUNDPIPE_PIN_MEMORY) is true, but page-locking host memory needs CUDA "
                         "and this machine has none. Set pin_memory=False (ROUNDPIPE_PIN_MEMORY=0) or leave it "
                         "unset.")
    names = {}
    for name, p in module.named_parameters():
        names.setdefault(id(p), name)
    exact_steps = not config.resolved_async_optimizer or bool(config.async_warmup_steps)
    # One process, or one rank of a data-parallel group over torch.distributed ([Note: gradient exchange]).
    exchange = gradient_exchange(config.data_parallel, config.resolved_wait_timeout_s)
    collect_earlier_engines()
    store = HostStore(list(pipeline), config.param_dtype, config.optimizer_dtype, pin, names,
                      pin_optimizer_copies=exact_steps, pad_multiple=exchange.pad_multiple,
                      defer_compute_locks=True)  # [Note: compute copies locked where they cross]
    _stores.add(store)
    exchange.check_same("the engine settings", _settings_every_rank_shares(config, len(devices), len(pipeline), store))
    exchange.broadcast_weights(store)
    partition = plan_partition(len(pipeline), forward_stages=config.forward_stages,
                               backward_stages=config.backward_stages)
    failure = FailureFlag(config.resolved_wait_timeout_s)
    passes = PassCounts(config.seed if config.seed is not None else torch.initial_seed())
    dp = exchange.group  # one trace file per rank ([Note: one trace per rank])
    trace = TraceRecorder(config.trace_path, dp.rank if dp else None, exchange.world_size) \
        if config.trace_path else None
    plan = MeasuredPlan(config, devices, store)  # [Note: measured plan]
    # Unplanned passes are sized from the model's config ([Note: first-pass micro-batches]); the partition they run
    # is this one (the measured plan replaces both at once).
    # At large batches their backward stages hold several layers ([Note: first-pass backward stages]): only the
    # engine's own partition, in one process.
    own_partition = config.forward_stages is None and config.backward_stages is None
    sizer = FirstPassSizer(getattr(module, "config", None), store, plan, partition,
                           regroup=own_partition, saved_on_host=not uses_cuda)
    # `allow_short_batches`: see [Note: short batches].
    microbatches = MicrobatchPolicy(config, len(devices), plan, allow_short_batches, sizer)
    dispatch = Dispatcher(config, devices, store, failure, plan, trace)
    deferred = DeferredPasses(store, failure)
    threads = EngineThreads(dispatch, deferred, failure, exchange, store)
    # Run at exit ([Note: clean exit under data parallelism]) or when dropped: the threads exist only now.
    exchange.bind(failure, threads.finish_collectives)
    # A failure during a step refuses reads of the torn weights, on the user's module too ([Note: torn weights]).
    torn = TornGuard(store.buckets, failure)

    def is_trainable(param: nn.Parameter) -> bool:
        """Whether the host store keeps an optimizer copy (and gradients) for the user's `param`."""
        return store.buckets[store.bucket_of[id(param)][0]].trainable

    adapters = AdapterSwitches(list(pipeline), is_trainable)  # [Note: adapter switches]
    buffers = LayerBuffers(list(pipeline))  # [Note: layer buffers followed]
    # [Note: saved inputs in host memory]: a pass's saved inputs against the host's available memory
    pool = store.saved_input_buffers  # [Note: saved inputs in pooled blocks]
    saved_room = SavedInputRoom(getattr(module, "config", None), sizer.element_size,
                                on_host=not any(d.is_cuda for d in devices), summary=config.resolved_summary,
                                block_of=pool.block_size if pool is not None else None)
    launch = PassLauncher(config, store, failure, partition, plan, dispatch, deferred, threads, adapters, passes,
                          buffers, saved_room)
    return EngineParts(devices, exchange, store, failure, passes, trace, plan, microbatches, dispatch, deferred,
                       threads, torn, launch)


def _settings_every_rank_shares(config: RoundPipeConfig, num_devices: int, num_layers: int,
                                store: HostStore) -> dict[str, Any]:
    return {"number of devices": num_devices, "num_microbatches": config.num_microbatches,
            "microbatches_per_round": config.microbatches_per_round,
            "async_optimizer": config.resolved_async_optimizer, "async_warmup_steps": config.async_warmup_steps,
            "param_dtype": str(config.param_dtype), "optimizer_dtype": str(config.optimizer_dtype),
            "number of layers": num_layers,
            "buckets (layers, trainable, elements, dtype)": [[list(b.layers), b.trainable, b.compute.numel(),
                                                              str(b.compute.dtype)] for b in store.buckets]}
