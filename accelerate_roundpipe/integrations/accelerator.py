"""`RoundPipeAccelerator`: `accelerate.Accelerator` with RoundPipe underneath, so a stock loop keeps its meaning.

    accelerator = RoundPipeAccelerator(roundpipe_plugin=RoundPipePlugin(devices=["cuda:0", "cuda:1"]))
    model, optimizer, train_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, scheduler)
    for batch in train_dl:
        with accelerator.accumulate(model):
            loss = model(**batch).loss          # the fused pipelined forward + backward
            accelerator.backward(loss)          # commits the gradients, scaled by 1 / accumulation steps
                                                # ([Note: deferred gradient commit])
            accelerator.clip_grad_norm_(model.parameters(), 1.0)   # the real norm
            optimizer.step(); scheduler.step(); optimizer.zero_grad()   # lagged CPU step

One process drives every device of a machine. Several machines train data-parallel, one process each (MULTI_GPU or
MULTI_CPU, [Note: one process per machine]): the model is never wrapped in DDP (the engine reduces its gradients
itself), the dataloader is sharded as usual (each rank gets its share of the global batch), and `backward` scales a
loss the way the engine's summed gradients need ([Note: data-parallel loss scaling]). One process per GPU, FSDP and
DeepSpeed are refused with the setting to change. Batches stay in host memory (`accelerator.device` is the CPU); the
engine uploads micro-batches to its workers itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from typing import Any

import accelerate
import torch
from accelerate.utils import DynamoBackend, send_to_device
from torch import nn

from ..compat.accelerate_internals import (
    check_accelerator_overrides,
    check_models_loaded_through_load_state_dict,
    dynamo_backend,
    is_prepared,
    mark_prepared,
    original_accelerator,
    prepared_models,
    prepared_optimizers,
    turn_off_autocast,
)
from ..runtime import RoundPipe
from ..runtime.optimizer import foreign_steps
from .checkpoint import EngineWeights, detached_state_dict, load_engine_extras, save_engine_extras
from .checkpoint_files import read_optimizer_shard
from .convert import convert_model, engine_of
from .grad_norm import clip_grad_norm, clip_grad_value
from .multi_process import (
    RankAgreement,
    backward_scale,
    check_distributed_type,
    check_engine_data_parallel,
    check_every_rank_saves,
    check_one_process_per_machine,
    collective_device,
    follow_wait_timeout,
    gather_claims,
    loss_kind,
    missing_shard_error,
    per_rank_name,
    rank_suffix,
    written_by_another_world_size,
)
from .optimizer import PREPARE_THE_OPTIMIZER, PREPARE_TOGETHER, RoundPipeAcceleratedOptimizer, repoint_optimizer
from .plugin import RoundPipePlugin
from .staged_checkpoint import together
from .traces import write_traces

logger = logging.getLogger(__name__)

ONE_PROCESS = ("RoundPipe drives every GPU of a machine from one process and replaces DeepSpeed, FSDP and "
               "Megatron-LM: on one machine launch a single process (`accelerate launch --num_processes 1`, "
               "distributed_type: NO) and list the GPUs in ROUNDPIPE_DEVICES (e.g. 'cuda:0,cuda:1'); on several, "
               "one process per machine (distributed_type: MULTI_GPU).")


class RoundPipeAccelerator(accelerate.Accelerator):
    """An `accelerate.Accelerator` whose `prepare` puts models on RoundPipe.

    Args:
        roundpipe_plugin (`RoundPipePlugin`, *optional*): the RoundPipe settings. Default: `RoundPipePlugin()`,
            i.e. the `ROUNDPIPE_*` environment variables, else the documented defaults.
        **kwargs: everything `accelerate.Accelerator` takes. `mixed_precision="bf16"` makes the compute copies
            bfloat16 (unless the plugin sets `param_dtype`) with float32 optimizer copies; fp16/fp8, DeepSpeed,
            FSDP, Megatron-LM and parallelism configs are refused.
    """

    def __init__(self, *args: Any, roundpipe_plugin: RoundPipePlugin | None = None, **kwargs: Any) -> None:
        for name in ("deepspeed_plugin", "deepspeed_plugins", "fsdp_plugin", "megatron_lm_plugin", "torch_tp_plugin",
                     "parallelism_config"):
            if kwargs.get(name) is not None:
                raise ValueError(f"RoundPipeAccelerator got `{name}`; {ONE_PROCESS} Drop `{name}`.")
        check_accelerator_overrides(RoundPipeAccelerator, original_accelerator())  # [Note: compatibility reaches]
        self.roundpipe_plugin = roundpipe_plugin if roundpipe_plugin is not None else RoundPipePlugin()
        super().__init__(*args, **kwargs)
        check_distributed_type(self.distributed_type, self.num_processes)
        if self.num_processes > 1:  # a collective: every rank constructs its accelerator
            timeout_s = self.roundpipe_plugin.resolved_wait_timeout_s
            follow_wait_timeout(timeout_s)  # [Note: collective timeouts]
            check_one_process_per_machine(gather_claims(self.roundpipe_plugin.resolved_devices(), timeout_s))
        self._refuse_compilation()
        self._adopt_mixed_precision()
        self._roundpipe_engines: list[RoundPipe] = []
        # Which models given to `prepare_model(..., evaluation_mode=True)` never train: they go on RoundPipe frozen
        # (compute copies only, no optimizer copy or gradient buffer). `RoundPipeTrainer` sets it (a DPO reference).
        self.frozen_for_evaluation: Callable[[nn.Module], bool] = lambda model: False
        self._roundpipe_load_dir: str | None = None
        self._roundpipe_set_aside: list = []  # optimizers `load_state` loads itself (_remember_load_dir)
        # What the engine's start summary says about the loop around it (the Trainer states its own settings).
        self.roundpipe_summary_notes = {
            "clipping": "exact, where the loop calls accelerator.clip_grad_norm_ (no pipeline drain)",
            "gradient accumulation": f"{self.gradient_accumulation_steps} batch(es) per optimizer step"}
        self.roundpipe_optimizer_hint = PREPARE_TOGETHER  # how a wrong optimizer's error says to fix it
        self.register_load_state_pre_hook(self._remember_load_dir)

    def _refuse_compilation(self) -> None:
        backend = dynamo_backend(self)
        if backend != DynamoBackend.NO:
            raise ValueError(f"dynamo_backend={backend.value!r} is set, but RoundPipe runs each layer on its "
                             f"own workers, outside any compiled graph. Set dynamo_backend to 'no' (accelerate config "
                             f"/ --dynamo_backend no / ACCELERATE_DYNAMO_BACKEND=no).")

    def _adopt_mixed_precision(self) -> None:
        """Turn accelerate's autocast into RoundPipe compute dtypes: autocast is per thread, and the engine's
        workers are other threads, so it would silently do nothing."""
        precision = str(self.state.mixed_precision)
        if precision == "no":
            return
        if precision != "bf16":
            raise ValueError(f"mixed_precision={precision!r} is not supported with RoundPipe: fp16 needs loss scaling "
                             f"(a GradScaler) and fp8 an autocast recipe, neither of which RoundPipe's workers and "
                             f"CPU optimizer apply, in either step mode. Use mixed_precision='bf16', or set "
                             f"`param_dtype` (env ROUNDPIPE_PARAM_DTYPE) and mixed_precision='no'.")
        if self.roundpipe_plugin.param_dtype is None:
            self.roundpipe_plugin.param_dtype = torch.bfloat16
            logger.info("mixed_precision='bf16': RoundPipe computes with bfloat16 compute copies and keeps float32 "
                        "optimizer copies (param_dtype=bfloat16).")
        turn_off_autocast(self)

    # ------------------------------------------------------------------ where things live

    @property
    def device(self) -> torch.device:
        """Inputs and outputs stay in host memory: the engine uploads micro-batches to its workers itself."""
        return torch.device("cpu")

    def roundpipe_engine(self, model: nn.Module) -> RoundPipe | None:
        """The RoundPipe engine behind a prepared model (e.g. to read `engine.partition` or `close()` it)."""
        return engine_of(model)

    # ------------------------------------------------------------------ prepare

    def prepare(self, *args, device_placement=None):
        # Models first, whatever the argument order: the optimizer is re-pointed to their optimizer copies.
        for obj in args:
            if isinstance(obj, nn.Module):
                self._convert(obj)
        return super().prepare(*args, device_placement=device_placement)

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False):
        if evaluation_mode and engine_of(model) is None and self.frozen_for_evaluation(model):
            model.requires_grad_(False)
        prepared = self._convert(model)
        models = prepared_models(self)
        if prepared not in models:
            models.append(prepared)
        mark_prepared(prepared)
        return prepared

    def _convert(self, model: nn.Module) -> nn.Module:
        prepared, engine = convert_model(model, self.roundpipe_plugin)
        # [Note: deferred gradient commit]: `backward` divides the loss by the accumulation steps; tell the engine.
        engine.expect_grad_scale(1.0 / self.gradient_accumulation_steps)
        engine.summary_notes.update(self.roundpipe_summary_notes)
        # A step of an optimizer over this model that was not prepared is refused, naming `prepare`.
        foreign_steps.watch(engine, PREPARE_THE_OPTIMIZER)  # [Note: optimizers the engine does not step]
        try:
            check_engine_data_parallel(engine, self.num_processes)
        except ValueError:
            engine.close()
            raise
        if engine not in self._roundpipe_engines:
            self._roundpipe_engines.append(engine)
        return prepared

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement=None):
        optimizers = prepared_optimizers(self)
        if is_prepared(optimizer):
            if optimizer not in optimizers:
                optimizers.append(optimizer)
            return optimizer
        prepared = RoundPipeAcceleratedOptimizer(repoint_optimizer(optimizer, self._roundpipe_engines,
                                                                   self.roundpipe_optimizer_hint))
        optimizers.append(prepared)
        return prepared

    def prepare_data_loader(self, data_loader, device_placement=None, slice_fn_for_dispatch=None):
        # Batches stay in host memory (see `device`).
        return super().prepare_data_loader(data_loader, device_placement=False,
                                           slice_fn_for_dispatch=slice_fn_for_dispatch)

    # ------------------------------------------------------------------ training-step helpers

    def backward(self, loss, **kwargs):
        """accelerate's `backward`; with several processes a loss computed from logits is scaled by 1/world_size
        first, so the engine's summed gradients are DDP's mean ([Note: data-parallel loss scaling])."""
        if self.num_processes > 1 and torch.is_tensor(loss) and loss.grad_fn is not None:
            scale = backward_scale(loss_kind(loss), self.num_processes)
            if scale != 1.0:
                loss = loss * scale
        return super().backward(loss, **kwargs)

    # Collectives: the caller's tensors live in host memory, which an NCCL process group cannot read.
    def gather(self, tensor):
        return self._on_collective_device(super().gather, tensor)

    def reduce(self, tensor, reduction="sum", scale=1.0):
        return self._on_collective_device(super().reduce, tensor, reduction, scale)

    def pad_across_processes(self, tensor, dim=0, pad_index=0, pad_first=False):
        return self._on_collective_device(super().pad_across_processes, tensor, dim, pad_index, pad_first)

    def _on_collective_device(self, collective, tensor, *args):
        device = collective_device(self.state)
        if self.num_processes <= 1 or device.type == "cpu":
            return collective(tensor, *args)
        return send_to_device(collective(send_to_device(tensor, device), *args), torch.device("cpu"))

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """The norm of the gradients RoundPipe holds for `parameters` (this step's, exact), clipped in place: by the
        step, or by a look before it, which then shows the clipped gradients ([Note: a clip applied by a look])."""
        return clip_grad_norm(list(parameters), self._roundpipe_engines, max_norm, norm_type)

    def clip_grad_value_(self, parameters, clip_value):
        clip_grad_value(list(parameters), self._roundpipe_engines, clip_value)

    def unwrap_model(self, model, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        """The user's model, showing the newest weights (the engine is synchronized first)."""
        engine = engine_of(model)
        if engine is None:
            return super().unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)
        engine.synchronize()
        return engine.module

    def get_state_dict(self, model, unwrap=True):
        engine = engine_of(model)
        if engine is None:
            return super().get_state_dict(model, unwrap)
        return detached_state_dict(engine)

    def free_memory(self, *objects):
        """accelerate's `free_memory` (and `clear`): every reference the accelerator keeps is released, the RoundPipe
        engines included, so an engine whose model the caller drops too is collected (its threads stopped, its
        pinned host store and device state given back) instead of living as long as the accelerator: a loop that
        retries a smaller batch after running out of memory builds a new engine each time. Engines are not closed
        here: `transformers.Trainer` calls this at the start of every `train()` and prepares the same model, and
        its engine, again."""
        self._roundpipe_engines = []
        return super().free_memory(*objects)

    def end_training(self) -> None:
        """accelerate's `end_training` (trackers finish), after writing each engine's timeline trace when recording
        (a stock loop never calls `close()`: [Note: trace at exit])."""
        write_traces(self._roundpipe_engines)
        super().end_training()

    def synchronize_roundpipe(self) -> None:
        """Wait for every pass and lagged step of every RoundPipe model."""
        for engine in self._roundpipe_engines:
            engine.synchronize()

    # ------------------------------------------------------------------ checkpoints

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **save_model_func_kwargs):
        """accelerate's `save_state` with the lagged steps flushed first (and the fp32 optimizer copies saved when
        the compute copies are narrower). With several processes each rank writes its optimizer shard, so every
        rank must call it: that is checked before anything is written ([Note: tagged agreements])."""
        self.synchronize_roundpipe()
        # Nothing held per rank (no optimizer): each rank writes its own files and waits for no other, as accelerate.
        agreement = self._agreement() if prepared_optimizers(self) else None
        check_every_rank_saves(agreement, output_dir)
        with self._optimizer_shards_aside() as shards:
            location = super().save_state(output_dir, safe_serialization=safe_serialization,
                                          **save_model_func_kwargs)

        def write_this_ranks_files() -> None:
            if shards:  # [Note: one process per machine]: each rank's optimizer state is its shard
                for index, optimizer in enumerate(shards):
                    torch.save(optimizer.state_dict(), os.path.join(location, self._shard_file(index)))
            for index, model in enumerate(prepared_models(self)):
                engine = engine_of(model)
                if engine is not None:
                    save_engine_extras(engine, location, suffix=self._extras_suffix(index))

        together(agreement, write_this_ranks_files, f"while saving the state to {location}")
        return location

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **load_model_func_kwargs):
        self.synchronize_roundpipe()
        self._roundpipe_set_aside = []
        with self._models_as_engine_weights(), self._optimizer_shards_aside() as shards:
            try:
                super().load_state(input_dir, load_kwargs=load_kwargs, **load_model_func_kwargs)
            finally:  # set aside by `_remember_load_dir`: one process loading the shards of several
                if self._roundpipe_set_aside:
                    prepared_optimizers(self)[:] = shards = self._roundpipe_set_aside
        directory = self._roundpipe_load_dir
        if directory is None:
            return
        written = None  # the number of processes that wrote the optimizer files, when not this run's
        for index, optimizer in enumerate(shards):
            other = written_by_another_world_size(directory, self._shard_file(index, world_size=1),
                                                  self.process_index, self.num_processes)
            if other is not None:  # [Note: shards of another world size]
                paths, written = other
                states = [read_optimizer_shard(path) for path in paths]
                if written > 1:
                    getattr(optimizer, "optimizer", optimizer).load_shards(states)  # the engine's LaggedOptimizer
                else:
                    optimizer.load_state_dict(states[0])
                continue
            path = os.path.join(directory, self._shard_file(index))
            if not os.path.isfile(path):
                raise missing_shard_error(directory, self._shard_file(index, world_size=1), self.process_index,
                                          self.num_processes)
            optimizer.load_state_dict(read_optimizer_shard(path))
        for index, model in enumerate(prepared_models(self)):
            engine = engine_of(model)
            if engine is not None:  # another world size's: rank 0's (the same weights and state on every rank)
                suffix = self._extras_suffix(index) if written is None else \
                    (f"_{index}" if index else "") + rank_suffix(0, written)
                load_engine_extras(engine, directory, suffix=suffix)

    def _shard_file(self, index: int, world_size: int | None = None) -> str:
        """accelerate's optimizer file name, per rank: `optimizer.rank1-of-2.bin`, `optimizer_1.rank1-of-2.bin`."""
        from accelerate.utils import OPTIMIZER_NAME

        name = f"{OPTIMIZER_NAME}.bin" if index == 0 else f"{OPTIMIZER_NAME}_{index}.bin"
        return per_rank_name(name, self.process_index, self.num_processes if world_size is None else world_size)

    def _extras_suffix(self, index: int) -> str:
        return (f"_{index}" if index else "") + rank_suffix(self.process_index, self.num_processes)

    def _agreement(self) -> RankAgreement | None:
        return RankAgreement(timeout_s=self.roundpipe_plugin.resolved_wait_timeout_s) if self.num_processes > 1 \
            else None

    @contextlib.contextmanager
    def _optimizer_shards_aside(self):
        """With several processes, accelerate's `save_state`/`load_state` would write only the main process's
        optimizer state (a shard) and load it into every rank: they see no optimizer, and each rank writes and
        reads its own shard. Yields the optimizers set aside (none for one process)."""
        if self.num_processes <= 1:
            yield []
            return
        optimizers = prepared_optimizers(self)
        saved = list(optimizers)
        optimizers[:] = []
        try:
            yield saved
        finally:
            optimizers[:] = saved

    def _remember_load_dir(self, models, input_dir: str) -> None:
        """accelerate's pre-load hook: where the state is loaded from; on one process, when the optimizer files are
        the shards of several, the optimizers are set aside (accelerate would look for `optimizer.bin`) and
        `load_state` joins the shards into them ([Note: shards of another world size])."""
        self._roundpipe_load_dir = input_dir
        optimizers = prepared_optimizers(self)
        if self.num_processes == 1 and optimizers and written_by_another_world_size(
                input_dir, self._shard_file(0, world_size=1), 0, 1) is not None:
            self._roundpipe_set_aside = list(optimizers)
            optimizers[:] = []

    @contextlib.contextmanager
    def _models_as_engine_weights(self):
        """accelerate loads model weights with `model.load_state_dict`; route RoundPipe models through the engine
        (same list positions, so the file names accelerate picks stay right)."""
        check_models_loaded_through_load_state_dict()  # [Note: compatibility reaches]
        models = prepared_models(self)
        saved = list(models)
        models[:] = [EngineWeights(e) if (e := engine_of(m)) is not None else m for m in saved]
        try:
            yield
        finally:
            models[:] = saved
