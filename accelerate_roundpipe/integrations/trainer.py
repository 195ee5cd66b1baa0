"""`RoundPipeTrainer`: `transformers.Trainer` on RoundPipe.

What changes under the Trainer's loop, and nothing else:
- the accelerator is a `RoundPipeAccelerator`: `prepare` puts the model on RoundPipe (weights in host memory, never
  moved to a GPU, never wrapped in `DataParallel`) and re-points the optimizer the Trainer built (fused CPU AdamW by
  default) to the engine's optimizer copies, stepped on the optimizer thread (exactly by default, one step late with
  `async_optimizer`);
- `training_step` is one fused pipelined `forward_backward` per batch, its gradients committed with the scale the
  Trainer would have given `backward` (custom `compute_loss`/`compute_loss_func`/label smoothing, and a model loss
  function other than transformers' causal-LM loss, go through the model's patched forward instead, exact too:
  [Note: the model's own loss function] in `models/causal_lm.py`);
- the gradient norm: with `max_grad_norm > 0` it is this step's, exact ([Note: clipping without a drain]); without
  clipping it is measured on the optimizer thread and logged one step late ([Note: late grad norm]);
- checkpoints flush the steps in flight first (through the patched `save_pretrained` and the optimizer's
  `state_dict`), and weights loaded into the model later (resume, best model) refresh the optimizer copies.

A single process drives every device of a machine, so batch sizes are per machine, not per GPU (`n_gpu` is at most
1). Several machines train data-parallel, one process each ([Note: one process per machine]): each rank trains on
its share of the global batch, the engine's fused loss is the global batch's (the Trainer's num_processes factor is
divided out again: [Note: data-parallel loss scaling]), rank 0 writes the model as a normal HF checkpoint and every
rank its optimizer shard (`optimizer.rank<r>-of-<n>.pt`), inside the staged checkpoint ([Note: staged checkpoints]).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import re
from typing import Any

import torch
from accelerate.utils import send_to_device
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, IntervalStrategy

from ..compat.hf_trainer import (
    check_trainer_overrides,
    limit_gpus_per_process,
    rotate_checkpoints,
    trainer_file_names,
    trainer_module_name_swapped,
    trainer_module_original,
    training_step_grad_scale,
)
from ..models import CausalLMRoundPipe
from ..telemetry.metrics import MetricsWindow, model_training_flops_per_token
from .accelerator import RoundPipeAccelerator
from .checkpoint import load_engine_extras, refresh_optimizer_copies, save_engine_extras
from .checkpoint_files import read_optimizer_shard
from .convert import engine_of
from .grad_norm import LateGradNorm
from .multi_process import (
    DEFERRED,
    RankAgreement,
    loss_kind,
    missing_shard_error,
    named_collective,
    per_rank_name,
    rank_suffix,
    trainer_loss_multiplier,
    written_by_another_world_size,
)
from .staged_checkpoint import staged
from .traces import write_traces
from .training_args import RoundPipeTrainingArguments, plugin_from_training_args

logger = logging.getLogger(__name__)


def check_training_args(args) -> None:
    """Refuse settings that assume one process per GPU or move/cast the model; turn off HF checkpointing."""
    refused = {
        "fsdp": "RoundPipe replaces FSDP",
        "deepspeed": "RoundPipe replaces DeepSpeed",
        "parallelism_config": "RoundPipe replaces tensor/context parallelism",
        "torch_compile": "the engine runs each layer on its own workers, outside the compiled graph",
        "fp16": ("fp16 needs loss scaling (a GradScaler), which RoundPipe's CPU optimizer does not apply, in either "
                 "step mode; use bf16 (bfloat16 compute copies, float32 optimizer copies) or roundpipe_param_dtype"),
        "fp16_full_eval": "it casts the model in place; use roundpipe_param_dtype",
        "bf16_full_eval": "it casts the model in place; use roundpipe_param_dtype",
    }
    for name, why in refused.items():
        if getattr(args, name, None):
            raise ValueError(f"`{name}` is set, but it cannot be used with RoundPipe: {why}. Unset `{name}`.")
    if args.world_size > 1 and not getattr(args, "average_tokens_across_devices", True):
        # [Note: data-parallel loss scaling]: the loss is normalised by the global token count, as on one process.
        logger.warning("Setting `average_tokens_across_devices=True`: with %d processes RoundPipe computes the loss "
                       "of the whole global batch, normalised by its token count.", args.world_size)
        args.average_tokens_across_devices = True
    for name in ("activation_checkpointing", "gradient_checkpointing"):
        if getattr(args, name, False):
            logger.warning("Setting `%s=False`: RoundPipe recomputes activations itself (see ROUNDPIPE_RECOMPUTE).",
                           name)
            setattr(args, name, False)
    # One process drives every GPU: no DataParallel, and `train_batch_size` is not multiplied by the GPU count.
    limit_gpus_per_process(args, 1)


def check_batch_against_microbatches(args, plugin) -> None:
    """A training batch smaller than `num_microbatches` on every step is a setting mistake
    ([Note: short batches]): say so before training starts, not at the second step."""
    requested, rows = plugin.num_microbatches, args.per_device_train_batch_size
    if requested is not None and rows < requested:
        raise ValueError(f"per_device_train_batch_size={rows} is smaller than the micro-batch count, "
                         f"{plugin.setting_as_given('num_microbatches')}: every micro-batch needs a row of the batch. "
                         f"Set num_microbatches to at most {rows} there, or per_device_train_batch_size to at least "
                         f"{requested}.")


WRONG_TRAINER_OPTIMIZER = (
    "The optimizer passed as `optimizers=(optimizer, scheduler)` must be built over the parameters of the model "
    "passed as `model=` (e.g. `torch.optim.AdamW(model.parameters(), lr=...)`, before the Trainer is built); or "
    "leave `optimizers` unset and the Trainer builds one from `optim` and `learning_rate`.")


def summary_notes(args) -> dict[str, str]:
    """What the engine's start summary says about the Trainer's settings."""
    if args.max_grad_norm and args.max_grad_norm > 0:
        clipping = f"max_grad_norm={args.max_grad_norm:g} (exact, this step's norm, no pipeline drain)"
    else:
        clipping = "off (max_grad_norm=0; the logged grad_norm is one step late)"
    return {"clipping": clipping,
            "gradient accumulation": f"{args.gradient_accumulation_steps} batch(es) per optimizer step"}


class RoundPipeTrainer(Trainer):
    """`transformers.Trainer` whose model runs on RoundPipe. Takes the same arguments; `args` may be any
    `TrainingArguments` (RoundPipe settings then come from `ROUNDPIPE_*`) or a `RoundPipeTrainingArguments`."""

    def __init__(self, model=None, args=None, *more, **kwargs) -> None:
        check_trainer_overrides(RoundPipeTrainer, Trainer)  # [Note: compatibility reaches]
        if args is None:
            args = RoundPipeTrainingArguments(output_dir="tmp_trainer")
        check_training_args(args)
        self.roundpipe_plugin = plugin_from_training_args(args)
        check_batch_against_microbatches(args, self.roundpipe_plugin)
        self._late_grad_norm: LateGradNorm | None = None
        # Not `_metrics`: TRL's trainers, which may sit on top of this class, keep their own `_metrics` dict.
        self._roundpipe_metrics: MetricsWindow | None = None
        self._staging_run_dir: str | None = None  # while a checkpoint is written ([Note: staged checkpoints])
        super().__init__(model, args, *more, **kwargs)
        self.accelerator.roundpipe_summary_notes = summary_notes(self.args)
        self.accelerator.roundpipe_optimizer_hint = WRONG_TRAINER_OPTIMIZER
        self.add_callback(_FinishAtTrainEnd())
        self._show_weights_to_callbacks()

    def _show_weights_to_callbacks(self) -> None:
        """[Note: callbacks see the newest weights]
        Before an event that a callback of the user's own (or another library's: TRL's SyncRefModelCallback)
        handles, and whose handler names the model, the engine is synchronized, so the `model=` it is given shows
        the weights after every step taken, as under the plain Trainer. Without it an `on_step_end` reading
        `model.named_parameters()` (an EMA, a weight-norm log) saw the initial weights at every step of an exact run:
        the model shows the newest weights only after a look. A look changes no step
        ([Note: looking changes nothing]), but it waits for the step in flight, which the next pass would otherwise
        overlap: transformers' own callbacks read no weights, and handlers that never name the model (timers,
        loggers of `logs`) cost none (`_reads_the_model`)."""
        handler = self.callback_handler
        call_event = handler.call_event

        def looking_call_event(event, *args, **kwargs):
            engine = self.roundpipe_engine
            if engine is not None and not engine.closed and \
                    any(_reads_the_model(callback, event) for callback in handler.callbacks):
                engine.synchronize()
            return call_event(event, *args, **kwargs)

        handler.call_event = looking_call_event

    @property
    def roundpipe_engine(self):
        """The engine behind `self.model` (created when training or evaluation first prepares the model)."""
        return engine_of(self.model)

    # ------------------------------------------------------------------ placement

    def create_accelerator_and_postprocess(self) -> None:
        # The base class builds `Accelerator(**kwargs)` from its module namespace; swap in ours for that one call
        # rather than copying the version-specific set-up code.
        ours = functools.partial(RoundPipeAccelerator, roundpipe_plugin=self.roundpipe_plugin)
        with trainer_module_name_swapped("Accelerator", ours, Trainer.create_accelerator_and_postprocess):
            super().create_accelerator_and_postprocess()
        self.accelerator.frozen_for_evaluation = self._is_auxiliary_model

    def _is_auxiliary_model(self, model) -> bool:
        """A model other than the one this Trainer trains, prepared for evaluation only: TRL's DPO reference model.
        It goes on RoundPipe frozen (see `RoundPipeAccelerator.frozen_for_evaluation`)."""
        return all(model is not mine for mine in (getattr(self, "model", None), getattr(self, "model_wrapped", None)))

    def _move_model_to_device(self, model, device) -> None:
        pass  # the weights live in RoundPipe's host store; the engine moves what the devices need

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        return model  # never DataParallel: the engine drives every device from this process

    def _prepare_input(self, data: Any) -> Any:
        """Batches stay in host memory; the engine uploads micro-batches to its workers."""
        return send_to_device(data, torch.device("cpu"))

    def get_batch_samples(self, epoch_iterator, num_batches: int, device=None):
        # The token count the loss is scaled by stays on the host too (else it goes to the GPU and back each step).
        return super().get_batch_samples(epoch_iterator, num_batches, torch.device("cpu"))

    # ------------------------------------------------------------------ the Trainer's own collectives

    @property
    def _wait_timeout_s(self) -> float:
        return self.roundpipe_plugin.resolved_wait_timeout_s

    def _get_num_items_in_batch(self, batch_samples: list, device):
        """The Trainer's per-step all-gather of the label count, named when it fails
        ([Note: collective timeouts])."""
        if self.args.world_size <= 1:
            return super()._get_num_items_in_batch(batch_samples, device)
        with named_collective("the Trainer's all-gather of the batch's label count (num_items_in_batch)",
                              self._wait_timeout_s):
            return super()._get_num_items_in_batch(batch_samples, device)

    def _maybe_log_save_evaluate(self, *args, **kwargs):
        """The Trainer's all-gather of the logged loss, named when it fails ([Note: collective timeouts]): the
        module-level `nested_gather` it calls is swapped for this call (on this thread), as the Accelerator class
        is in `create_accelerator_and_postprocess`."""
        if self.args.world_size <= 1:
            return super()._maybe_log_save_evaluate(*args, **kwargs)
        original, timeout_s = trainer_module_original("nested_gather"), self._wait_timeout_s

        def named_gather(tensors, *more, **options):
            with named_collective("the Trainer's all-gather of the training loss it logs (nested_gather)",
                                  timeout_s):
                return original(tensors, *more, **options)

        with trainer_module_name_swapped("nested_gather", named_gather, Trainer._maybe_log_save_evaluate):
            return super()._maybe_log_save_evaluate(*args, **kwargs)

    # ------------------------------------------------------------------ live metrics

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        """Training logs gain `roundpipe/tokens_per_s`, `roundpipe/host_rss_gib`, with a GPU `roundpipe/gpu_peak_gib`,
        with `peak_tflops` `roundpipe/mfu` and with a trace `roundpipe/bubble`, measured since the previous log (the
        first since the first training step), added here, before the Trainer hands the logs to its history and its
        `report_to` reporters (TensorBoard shows them as `train/roundpipe/...`)."""
        engine = self.roundpipe_engine
        if engine is not None and "loss" in logs:
            if self._metrics_window(engine):
                logs = {**logs, **self._roundpipe_metrics.sample()}
        super().log(logs, *args, **kwargs)

    def _metrics_window(self, engine) -> bool:
        """Measure from now on for `engine`; True when a window was already open (so it has rates to give)."""
        if self._roundpipe_metrics is not None and self._roundpipe_metrics.counters is engine.counters:
            return True  # each engine counts into its own counters
        peak = engine.config.peak_tflops
        self._roundpipe_metrics = MetricsWindow(engine.counters, engine.trace, engine.devices,
                                                model_training_flops_per_token(engine.module),
                                                peak * 1e12 * len(engine.devices) if peak else None)
        return False

    # ------------------------------------------------------------------ training step

    def training_step(self, model, inputs, num_items_in_batch=None):
        engine = self.roundpipe_engine
        if engine is not None:
            self._metrics_window(engine)  # the first log's rates start at the first step
        accepts_items = self.model_accepts_loss_kwargs and num_items_in_batch is not None
        # What `Trainer.training_step` would multiply the loss's gradient by before `backward`.
        scale = training_step_grad_scale(self, num_items_in_batch, Trainer.training_step)
        if not self._runs_fused_step(engine, inputs):
            if engine is not None:
                engine.expect_grad_scale(scale)  # [Note: deferred gradient commit]
            return super().training_step(model, inputs, num_items_in_batch)
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        batch = dict(self._prepare_inputs(inputs))
        if accepts_items:
            batch["num_items_in_batch"] = num_items_in_batch.cpu() if torch.is_tensor(num_items_in_batch) \
                else num_items_in_batch
        loss = engine.forward_backward(**batch, grad_scale=scale)
        return (loss * scale).detach().to(self.args.device)

    def _runs_fused_step(self, engine, inputs) -> bool:
        """The model's own loss with nothing custom around it: one `forward_backward` computes all of it. A loss
        function of the model's own goes through `compute_loss` as `compute_loss_func` does: its loss is then this
        rank's under data parallelism, which the Trainer's scaling expects ([Note: the model's own loss function])."""
        return (isinstance(engine, CausalLMRoundPipe) and "labels" in inputs
                and type(self).compute_loss is RoundPipeTrainer.compute_loss
                and self.compute_loss_func is None and self.label_smoother is None
                and engine.custom_loss_function() is None)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """`Trainer.compute_loss`; with several processes, the num_processes factor it puts on a loss normalised by
        the global token count is taken off the engine's fused loss, which is the global batch's already
        ([Note: data-parallel loss scaling])."""
        result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                      num_items_in_batch=num_items_in_batch)
        if self.args.world_size <= 1:
            return result
        loss = result[0] if return_outputs else result
        factor = trainer_loss_multiplier(self.args.average_tokens_across_devices,
                                         bool(self.model_accepts_loss_kwargs or self.compute_loss_func),
                                         num_items_in_batch, self.accelerator.num_processes, self.get_tp_size(),
                                         self.args.n_gpu)
        if factor == 1 or not torch.is_tensor(loss) or loss.grad_fn is None or loss_kind(loss) != DEFERRED:
            return result
        loss = loss / factor
        return (loss, *result[1:]) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """`Trainer.prediction_step`. When only the loss is wanted (`evaluate()` without `compute_metrics`) and the
        model's own loss is all of it, the pipeline's head computes it and no logits are made: HF's `skip_logits`
        ([Note: evaluation loss] in `models/causal_lm.py`)."""
        if prediction_loss_only and self._runs_fused_step(self.roundpipe_engine, inputs):
            inputs = {**inputs, "skip_logits": True}
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is not None:
            return grad_norm  # from clipping: this step's norm, exact
        engine = self.roundpipe_engine
        lagged = getattr(self.optimizer, "optimizer", None)
        if engine is None or lagged is None or getattr(lagged, "inner", None) is None:
            return super()._get_grad_norm(model, grad_norm)
        if self._late_grad_norm is None or self._late_grad_norm.optimizer is not lagged:
            if self._late_grad_norm is not None:
                self._late_grad_norm.close()
            self._late_grad_norm = LateGradNorm(lagged)
        step = self.state.global_step  # the index of the step being taken; it is step number step + 1
        self._late_grad_norm.before_step(step, measure=self._next_step_logs(step + 1))
        return self._late_grad_norm.newest_norm(step - 1)  # [Note: late grad norm]

    def _next_step_logs(self, step_number: int) -> bool:
        """Whether the step after step number `step_number` logs (the grad norm it reports is of this step)."""
        if self.args.logging_strategy != IntervalStrategy.STEPS:
            return True  # epoch-based logging: measure every step
        return (step_number + 1) % self.state.logging_steps == 0  # the Trainer's own rule (DefaultFlowCallback)

    # ------------------------------------------------------------------ checkpoints

    def _get_output_dir(self, trial) -> str:
        if self._staging_run_dir is not None:
            return self._staging_run_dir
        return super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial) -> None:
        """The Trainer's checkpoint, written under a temporary name and renamed into place once complete
        ([Note: staged checkpoints]). The engine is flushed first: an error of a step in flight surfaces before any
        directory exists."""
        engine = self.roundpipe_engine
        if engine is not None:
            engine.synchronize()
        run_dir = super()._get_output_dir(trial)
        final = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        agreement = RankAgreement(timeout_s=self._wait_timeout_s) if self.args.world_size > 1 else None
        with staged(final, agreement, is_writer=self.args.should_save) as staging:
            self._staging_run_dir = staging
            try:
                super()._save_checkpoint(model, trial)
            finally:
                self._staging_run_dir = None
            self._record_best_checkpoint(run_dir, staging, final)
        if self.args.should_save:  # the rotation the Trainer ran inside the staging directory, redone in the run's
            rotate_checkpoints(run_dir, self.args.save_total_limit, self.state.best_model_checkpoint)

    def _record_best_checkpoint(self, run_dir: str, staging: str, final: str) -> None:
        """Point `best_model_checkpoint` at the run directory (the Trainer looked for it in the staging one), and
        save the trainer state again with it."""
        if not self.state.best_global_step:
            return
        best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}")
        if best != final and not os.path.isdir(best):
            return
        self.state.best_model_checkpoint = best
        TRAINER_STATE_NAME, _, _ = trainer_file_names()
        state_file = os.path.join(staging, os.path.basename(final), TRAINER_STATE_NAME)
        if self.args.should_save and os.path.isfile(state_file):
            self.state.save_to_json(state_file)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        engine = self.roundpipe_engine
        if self.args.world_size > 1:  # the Trainer would write only rank 0's optimizer shard
            self._save_optimizer_shard(output_dir)
        else:
            super()._save_optimizer_and_scheduler(output_dir)  # the optimizer's state_dict() flushes the lagged step
        if engine is not None and (self.args.should_save or self.args.world_size > 1):
            save_engine_extras(engine, output_dir, suffix=self._rank_suffix())

    def _save_optimizer_shard(self, output_dir: str) -> None:
        """Every rank writes its optimizer state (a shard, [Note: one process per machine]); the main process the
        scheduler, as the Trainer does."""
        _, OPTIMIZER_NAME, SCHEDULER_NAME = trainer_file_names()
        os.makedirs(output_dir, exist_ok=True)
        torch.save(self.optimizer.state_dict(), os.path.join(output_dir, self._shard_name(OPTIMIZER_NAME)))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        _, OPTIMIZER_NAME, _ = trainer_file_names()
        suffix = self._rank_suffix()
        other = written_by_another_world_size(checkpoint, OPTIMIZER_NAME, self.args.process_index,
                                              self.args.world_size) if checkpoint is not None else None
        if other is not None:  # [Note: shards of another world size]
            paths, written = other
            self._load_optimizer_of_another_world_size(checkpoint, paths, written)
            suffix = rank_suffix(0, written)  # the weights and the engine state are the same on every rank
        elif self.args.world_size > 1:
            self._load_optimizer_shard(checkpoint)
        else:
            super()._load_optimizer_and_scheduler(checkpoint)
        engine = self.roundpipe_engine
        if checkpoint is not None and engine is not None:
            load_engine_extras(engine, checkpoint, suffix=suffix)

    def _load_optimizer_of_another_world_size(self, checkpoint: str, paths: list[str], written: int) -> None:
        """The optimizer state a run with `written` processes saved, loaded into this one's: the shards of all its
        ranks joined into the one-process state, of which each rank here takes its range."""
        _, _, SCHEDULER_NAME = trainer_file_names()
        if not os.path.isfile(os.path.join(checkpoint, SCHEDULER_NAME)):
            return  # as the Trainer: nothing to resume (e.g. save_only_model)
        lagged = getattr(self.optimizer, "optimizer", self.optimizer)
        states = [read_optimizer_shard(path) for path in paths]
        logger.info("Resuming the optimizer state of a run with %d process(es) on %d: %s", written,
                    self.args.world_size, ", ".join(os.path.basename(p) for p in paths))
        if written == 1:
            self.optimizer.load_state_dict(states[0])
        elif hasattr(lagged, "load_shards"):
            lagged.load_shards(states)
        else:
            raise ValueError(f"{checkpoint} holds the optimizer shards of {written} processes, which only a "
                             f"RoundPipe model's optimizer can join; this run has {self.args.world_size}: resume "
                             f"with {written} processes.")
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))

    def _load_optimizer_shard(self, checkpoint: str | None) -> None:
        _, OPTIMIZER_NAME, SCHEDULER_NAME = trainer_file_names()
        if checkpoint is None or not os.path.isfile(os.path.join(checkpoint, SCHEDULER_NAME)):
            return  # as the Trainer: nothing to resume (e.g. save_only_model)
        path = os.path.join(checkpoint, self._shard_name(OPTIMIZER_NAME))
        if not os.path.isfile(path):
            raise missing_shard_error(checkpoint, OPTIMIZER_NAME, self.args.process_index, self.args.world_size)
        self.optimizer.load_state_dict(read_optimizer_shard(path))
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))

    def _shard_name(self, filename: str) -> str:
        return per_rank_name(filename, self.args.process_index, self.args.world_size)

    def _rank_suffix(self) -> str:
        return rank_suffix(self.args.process_index, self.args.world_size)

    @contextlib.contextmanager
    def _reloading_weights(self):
        """Around a load of weights into the model: no step in flight while they are written, and the optimizer
        copies refreshed from them afterwards."""
        engine = self.roundpipe_engine
        if engine is not None:
            engine.synchronize()
        yield
        if engine is not None:
            refresh_optimizer_copies(engine)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        with self._reloading_weights():
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_best_model(self) -> None:
        with self._reloading_weights():
            super()._load_best_model()


def _reads_the_model(callback, event: str) -> bool:
    """Whether `callback` handles `event` and may read the model's weights there: any callback class but
    transformers' own (flow, progress, early stopping, the reporters) and this package's, whose handler names the
    model (a `model` parameter, `kwargs["model"]`, `self.model`). A handler that never names it (a timer, a logger of
    `logs` or `state`) costs no look: a look waits for the step in flight, which the next pass would overlap."""
    handler = getattr(type(callback), event, None)
    if handler is None or handler is getattr(TrainerCallback, event, None):
        return False
    if type(callback).__module__.startswith(("transformers.", "accelerate_roundpipe.")):
        return False
    return _names_the_model(handler)


@functools.lru_cache(maxsize=256)
def _names_the_model(handler) -> bool:
    """Whether the source of `handler` names `model` (True when its source cannot be read)."""
    try:
        source = inspect.getsource(handler)
    except (OSError, TypeError):
        return True
    return re.search(r"\bmodel\b", source) is not None


class _FinishAtTrainEnd(TrainerCallback):
    """When `train()` ends: every step of every rank done, so that a rank may leave at once (HF scripts' non-writing
    ranks return from `save_model` and exit: [Note: end of a data-parallel run]); then the engine's timeline trace
    (when recording: [Note: trace at exit])."""

    def on_train_end(self, args, state, control, model=None, **kwargs):
        engine = engine_of(model)
        if engine is not None:
            engine.synchronize_ranks()
            write_traces([engine])
