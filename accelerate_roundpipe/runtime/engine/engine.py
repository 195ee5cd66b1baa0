"""`RoundPipe`: the engine facade. Builds each pass, hands its tasks to the dispatcher, returns results.

All tickets of [Note: per-layer events] are reserved on the caller's thread, in program order (by the dispatcher, the
deferred passes and the optimizer's `step`/`zero_grad`): this is what makes the results independent of thread
timing. Call the engine from one thread.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ...config import RoundPipeConfig
from ...plan.layer_costs import LayerCosts
from ...plan.partition import Partition
from ...plan.schedule import Mode, Task
from ...telemetry.engine_view import EngineSnapshot
from ...telemetry.metrics import EngineCounters
from ...telemetry.summary import announce, engine_summary
from ...telemetry.trace import maybe_span, save_when_freed
from ..common.sync import EngineClosedError
from ..distribution.gloo_exchange import DataParallelGroup
from ..execution.deferred import DeferredCommit, DeferredLoss, single_commit_buckets
from ..execution.microbatches import (
    concatenated_outputs,
    loss_count_totals,
    loss_shares,
    split_rows,
    tensor_tuple,
    weighted_loss,
)
from ..optimizer import foreign_steps
from ..optimizer.optimizer import RoundPipeOptimizer
from ..state.host_resident import HostResidentModule
from ..state.host_store import HostStore
from ..state.placement import OptimizerPlacement
from ..state.weight_edits import FrozenEdits, WeightEdits, apply_edits, kept_values
from . import engine_checkpoint
from .engine_parts import build_engine_parts
from .engine_threads import note_exit_before_finalizers
from .pass_launch import PipelineBackward as _PipelineBackward  # the name integrations read
from .snapshot import engine_snapshot

logger = logging.getLogger(__name__)


class RoundPipe(HostResidentModule):
    """Runs an `nn.Sequential` with RoundPipe: weights, gradients and optimizer state on the host, devices as a
    stateless worker pool, forward and backward stages dispatched round-robin.

    Example::

        model = RoundPipe(torch.nn.Sequential(...), RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=4))
        optimizer = model.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
        loss = model.forward_backward(x, labels=y, loss_fn=torch.nn.functional.cross_entropy)
        optimizer.step(); optimizer.zero_grad()
        model.synchronize()  # model.module now holds the newest weights
    """

    def __init__(self, module: nn.Module, config: RoundPipeConfig | None = None, *,
                 layers: nn.Sequential | None = None, allow_short_batches: bool = False) -> None:
        super().__init__()
        pipeline = module if layers is None else layers
        if not isinstance(pipeline, nn.Sequential):
            raise TypeError(
                f"RoundPipe takes an nn.Sequential whose children are the pipeline layers; got "
                f"{type(module).__name__}. Wrap your layers in torch.nn.Sequential (each child's output feeding the "
                f"next), or use accelerate_roundpipe.wrap_model for Hugging Face causal LMs.")
        if len(pipeline) == 0:
            raise ValueError("RoundPipe got an empty nn.Sequential; it needs at least one layer.")
        self.config = config if config is not None else RoundPipeConfig()
        self.module = module  # registered as a submodule; read through the `module` property
        # The layers share their parameters with `module`; kept unregistered so parameters are not listed twice.
        object.__setattr__(self, "layers", pipeline)
        parts = build_engine_parts(module, pipeline, self.config, allow_short_batches)
        self.devices, self._exchange, self._store = parts.devices, parts.exchange, parts.store
        self.data_parallel: DataParallelGroup | None = parts.exchange.group  # [Note: data parallel]
        self._failure, self._passes, self.trace = parts.failure, parts.passes, parts.trace
        self._plan, self._microbatches, self._dispatch = parts.plan, parts.microbatches, parts.dispatch
        self._deferred, self._background = parts.deferred, parts.threads
        self._torn, self._launch = parts.torn, parts.launch
        self._placement: OptimizerPlacement | None = None  # made when the optimizer is wrapped
        self._weight_edits = WeightEdits(self._store)  # [Note: weight edits followed]
        self._frozen_edits = FrozenEdits(self._store)  # [Note: shared frozen weights]
        # Written when the engine is freed or the process exits, if nothing wrote it before ([Note: trace at exit]).
        self._trace_saver = save_when_freed(self, self.trace, self.config.resolved_summary) if self.trace else None
        self._torn_hook = module.register_state_dict_pre_hook(self._torn)
        self._finalizer: weakref.finalize | None = None  # stops the threads (started on first use)
        self.counters = EngineCounters()
        # Lines the integrations add to the start summary (e.g. "clipping"), which the engine cannot know itself.
        self.summary_notes: dict[str, str] = {}
        foreign_steps.watch(self)  # [Note: optimizers the engine does not step]

    # ------------------------------------------------------------------ parameters

    @property
    def module(self) -> nn.Module:
        """The wrapped module; its parameters are the compute copies. Refused with `TornWeightsError` after a
        failure that left its layers at different optimizer steps ([Note: torn weights])."""
        self._torn.check()
        return self._modules["module"]

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """The optimizer copies (host, `optimizer_dtype`) of trainable parameters and the compute copies of frozen
        ones, named as in the wrapped module."""
        for name, _, held in self._named_copies(remove_duplicate):
            yield prefix + name, held

    def parameter_copies(self) -> Iterator[tuple[nn.Parameter, nn.Parameter]]:
        """(compute copy, what `named_parameters()` yields for it) for each parameter of the wrapped module, in
        one walk of its modules (the Trainer's clip pairs them every step)."""
        for _, compute, held in self._named_copies(True):
            yield compute, held

    def _named_copies(self, remove_duplicate: bool) -> Iterator[tuple[str, nn.Parameter, nn.Parameter]]:
        """(name, compute copy, optimizer copy of a trainable parameter or the compute copy of a frozen one)."""
        for name, p in self._modules["module"].named_parameters(remove_duplicate=remove_duplicate):
            bucket_index, slot_index = self._store.bucket_of[id(p)]
            slot = self._store.buckets[bucket_index].slots[slot_index]
            yield name, p, slot.optim if slot.optim is not None else p

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    @property
    def layer_costs(self) -> LayerCosts | None:
        """Per-layer costs measured on the first training pass ([Note: measured plan]); None before or if static."""
        return self._plan.layer_costs

    @property
    def host_store(self) -> HostStore:  # every parameter, optimizer copy and gradient, in per-layer buffers
        return self._store

    @property
    def optimizer_placement(self) -> OptimizerPlacement | None:  # None until an optimizer is wrapped
        return self._placement

    @property
    def optimizer(self) -> RoundPipeOptimizer | None:
        return self._background.optimizer

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> RoundPipeOptimizer:
        """Step `optimizer` (built over `self.parameters()`) on a background thread, exactly by default or one step
        late (`async_optimizer`); returns the wrapper to use in its place. An LR scheduler may be built on either:
        `optimizer` keeps its groups (read at each `step()`), the wrapper holds the state."""
        if isinstance(optimizer, RoundPipeOptimizer):
            return optimizer
        self._failure.check()
        self._exchange.check_same("the optimizer", {
            "class": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}",
            "parameters per group": [len(g["params"]) for g in optimizer.param_groups]})
        self.synchronize()  # nothing in flight: the wrapped optimizer is replaced, buckets may move home
        if self._placement is None:  # once: [Note: optimizer placement]
            self._placement = self._plan.place_optimizer_state(optimizer, self._exchange.world_size > 1)
        wrapped = RoundPipeOptimizer(optimizer, self._store, self._failure, self.config.resolved_async_optimizer,
                                     deferred_passes=self._deferred, trace=self.trace, replaces=self.optimizer,
                                     exact_steps_first=self.config.resolved_async_warmup_steps,
                                     before_step=_weakly(self.follow_weight_edits),  # [Note: weight edits followed]
                                     layout_of=lambda user: self._exchange.optimizer_layout(user, self._store,
                                                                                            self.trace))
        self._background.use_optimizer(wrapped)
        self._torn.follow_optimizer(self.optimizer.write_back_after_failure)
        return self.optimizer

    # ------------------------------------------------------------------ passes

    def forward_backward(self, *inputs: torch.Tensor, labels: Any = None, loss_fn: Callable | None = None,
                         loss_reduction: str = "mean", grad_scale: float = 1.0,
                         deferred: bool = False, ignore_index: int | None = -100) -> torch.Tensor:
        """Fused pipelined forward + loss + backward over the whole batch; returns the loss.

        The loss and the gradients are those of `loss_fn(model(*inputs), labels)` on the whole batch
        ([Note: micro-batch loss weights]): with `loss_reduction="mean"` each micro-batch's loss is weighted by its
        share of what a mean over the whole batch counts: for integer `labels`, the labels other than
        `ignore_index` (None: count rows); otherwise the rows. `"sum"` adds them. Without `loss_fn` the last layer
        must return the micro-batch loss. Gradients, times `grad_scale`, accumulate into `p.grad` of
        `self.parameters()` (complete after `synchronize()` and before the next `optimizer.step()` uses them).
        With `deferred=True` the returned loss carries an autograd node: `backward()` reaching it with gradient c
        commits the pass's gradients scaled by c (`grad_scale` is ignored; `expect_grad_scale` sets the c the
        pipeline assumes, exact either way), and a pass never back-propagated is dropped at the next pass,
        `optimizer.step()` or `zero_grad()`. See [Note: deferred gradient commit]. Under data parallelism
        ([Note: data parallel]) each rank passes its share of the global batch; the weights count the global batch,
        and the loss returned is the global batch's, the same on every rank."""
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction={loss_reduction!r}; use 'mean' or 'sum'.")
        counted_labels = ignore_index if loss_fn is not None else None
        try:
            self._before_pass(inputs)
            self._launch.follow_user_layers(training=True)
            inputs = tensor_tuple(inputs, "forward_backward inputs")
            rows, num_mb, mb_inputs = self._split(inputs)
            mb_labels = split_rows(tensor_tuple(labels, "labels"), num_mb) if labels is not None else [None] * num_mb
            mb_rows = [x[0].shape[0] for x in mb_inputs]
            totals = loss_count_totals(mb_rows, mb_labels, counted_labels)
        except BaseException as error:
            if not isinstance(error, EngineClosedError):
                self._exchange.pass_failed(error, "the start of a training pass", self._failure)
            raise
        index = self._passes.num_passes  # the pass about to be built
        if loss_reduction == "mean":  # a sum of losses weighs each micro-batch 1: no counts to exchange
            totals = self.sum_over_ranks(totals, f"the exchange of label counts at the start of pass {index}")
        try:  # a failure up to the loss meets the peers in the loss's exchange: they raise naming this rank
            self.counters.count(inputs[0])
            shares = loss_shares(mb_rows, mb_labels, loss_reduction, counted_labels, totals)
            scale = self._deferred.expected_scale if deferred else grad_scale
            if deferred and scale == 0:
                raise ValueError("the expected gradient scale (expect_grad_scale) must be non-zero.")
            tasks = self._launch.schedule(num_mb, Mode.TRAIN)
            plan, results = self._launch.training_pass(
                self._modules["module"].training, mb_rows, inputs, mb_labels, loss_fn, [s * scale for s in shares],
                DeferredCommit(scale, single_commits=single_commit_buckets(tasks, self._store)) if deferred else None,
                len(self.layers))
            jobs = self._dispatch.enqueue(tasks, plan, results, mb_inputs)
            if results.profile is not None:
                self._plan.measured(results.profile, jobs, num_mb, rows)
            with maybe_span(self.trace, "caller", f"wait for the loss of pass {plan.index}"):
                losses = [loss.host()[0] for loss in results.take_losses(self._failure)]
        except BaseException as error:
            self._exchange.pass_failed(error, f"pass {index}", self._failure)
            raise
        total = weighted_loss(losses, shares)
        total = self._on_caller_thread(lambda: self._exchange.global_loss(
            total, f"the all-reduce of the loss of pass {plan.index}"))
        if not deferred:
            return total
        self._deferred.awaiting_backward(results.deferred)
        return DeferredLoss.apply(self, self._deferred, results.deferred, torch.empty(0, requires_grad=True), total)

    @property
    def data_parallel_world_size(self) -> int:
        """The processes this engine trains with over torch.distributed (1: one process). Under data parallelism
        each rank's `p.grad` holds its share of the gradient, the ranks' sum being the global one
        ([Note: data parallel])."""
        return self._exchange.world_size

    def sum_over_ranks(self, values: list[float], what: str) -> list[float]:
        """`values` (at most three) summed over the data-parallel ranks (on one process, `values`), on the caller's
        thread; every rank calls it at the same point. A failure fails the engine too ([Note: data parallel])."""
        return self._on_caller_thread(lambda: self._exchange.sum_over_ranks(values, what))

    def _on_caller_thread(self, collective: Callable[[], Any]) -> Any:
        try:
            return collective()
        except BaseException as error:
            self._failure.fail_here(error, "a data-parallel collective on the caller's thread")
            raise

    def drop_pending_gradients(self) -> None:
        """Drop the gradients of a deferred pass whose loss was never back-propagated."""
        self._deferred.drop_pending()

    def expect_grad_scale(self, scale: float) -> None:
        """Deferred passes from now on expect their loss's backward to bring gradient `scale`: exact whatever it
        brings, one host pass cheaper when it brings that ([Note: deferred gradient commit]). The integrations that
        drive a loop call this: its passes come through the model's forward, which takes no engine arguments."""
        self._deferred.expect_scale(scale)

    def forward(self, *inputs: torch.Tensor) -> Any:
        """Forward pipeline. With grad enabled the output is attached to the backward pipeline."""
        keep_for_backward = torch.is_grad_enabled() and bool(self._store.trainable_buckets)
        plan, results, pieces = self._forward_pieces(inputs, keep_for_backward)
        # Every task saved its inputs before its round's last output was set: the backward reads them, if it comes.
        saved_inputs = results.hand_over_saved_inputs()
        outputs = concatenated_outputs(pieces)
        if keep_for_backward:
            outputs = list(_PipelineBackward.apply(self, self._launch, plan, saved_inputs, self._launch.weight_epochs(),
                                                   torch.empty(0, requires_grad=True), *outputs))
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    @torch.no_grad()
    def forward_loss(self, *inputs: torch.Tensor) -> torch.Tensor:
        """Forward pipeline without gradients whose last layer returns each micro-batch's share of a loss (0-dim):
        their sum. An evaluation's loss, its logits never leaving the devices ([Note: evaluation loss])."""
        losses = [piece[0] for piece in self._forward_pieces(inputs, keep_for_backward=False)[2]]
        if any(loss.dim() for loss in losses):
            raise TypeError("forward_loss needs a last layer that returns a 0-dim loss per micro-batch.")
        return torch.stack(losses).sum()

    def _forward_pieces(self, inputs: tuple, keep_for_backward: bool) -> tuple[Any, Any, list[tuple]]:
        self._before_pass(inputs)
        inputs = tensor_tuple(inputs, "forward inputs")
        rows, num_mb, mb_inputs = self._split(inputs, strict=False)
        adapter_setting = self._launch.follow_user_layers(training=keep_for_backward)
        plan, results = self._launch.forward_pass(self._modules["module"].training, mb_inputs, inputs,
                                                  keep_for_backward, adapter_setting)
        self._dispatch.enqueue(self._launch.forward_schedule(num_mb, keep_for_backward), plan, results, mb_inputs)
        return plan, results, [output.host() for output in results.take_outputs(self._failure)]

    # ------------------------------------------------------------------ control

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget (or zero) the accumulated gradients of `parameters()`, through the wrapped optimizer's ordered
        `zero_grad` or once the passes in flight are done. (nn.Module's own would set `.grad` behind the buckets'
        back: the next commit would leave it None, and an optimizer skip every parameter.)"""
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none)
            return
        self.synchronize()
        for bucket in self._store.trainable_buckets:
            if set_to_none:
                bucket.clear()
            else:
                bucket.zero()

    def synchronize(self) -> None:
        """Wait for every task and optimizer step; then `self.module` holds the newest weights and `p.grad` of
        `self.parameters()` the accumulated gradients."""
        self._failure.check()
        if self.optimizer is not None:  # [Note: parameters without a gradient]
            self.optimizer.follow_user_grads()
        edits = self._weight_edits.edited()  # [Note: weight edits followed]
        values = kept_values(edits) if edits else None
        self._dispatch.wait_inflight()
        self._deferred.wait_idle()
        if self.optimizer is not None:
            self.optimizer.synchronize()
        self._failure.check()
        if edits:
            apply_edits(edits, values)
            self._weight_edits.took_in()
            logger.debug("parameters changed in place after wrapping, followed: %s",
                         ", ".join(bucket.slots[i].name for bucket, slots in edits.values() for i in slots))

    @property
    def weight_edits_followed(self) -> int:
        """How many looks took in parameters the user changed in place ([Note: weight edits followed])."""
        return self._weight_edits.followed

    def follow_weight_edits(self) -> None:
        """Take in parameters the user changed in place since the engine last looked
        ([Note: weight edits followed]): a `synchronize()` when one changed, else nothing."""
        if self._weight_edits.edited():
            self.synchronize()

    def wait_for_work(self) -> None:
        """Wait for every task and optimizer step queued so far, without a look: unlike `synchronize()`, nothing is
        copied into the compute copies (a look at buckets stepped on a GPU downloads all of them), so the work
        waited for is what a training loop runs. For timing steps; `self.module` may show older weights after it."""
        self._failure.check()
        self._dispatch.wait_inflight()
        self._deferred.wait_idle()
        if self.optimizer is not None:
            self.optimizer.wait_for_steps()
        self._failure.check()

    def synchronize_ranks(self) -> None:
        """`synchronize()`, then, under data parallelism, wait until every rank got here: every collective of every
        rank's steps is then done, so a rank may leave ([Note: end of a data-parallel run]). Call it on every rank
        at the same point (the Trainer does at the end of `train()`)."""
        self.synchronize()
        self._exchange.meet_peers()

    def close(self) -> None:
        """Stop the worker and optimizer threads (and write the trace, if recording). The engine cannot be used
        afterwards. Under data parallelism, after steps since the last `synchronize_ranks()`, it waits for the
        other ranks to close too ([Note: end of a data-parallel run])."""
        if not self._failure.closed:
            try:
                if self._failure.error is None:
                    self.synchronize()
                    self._exchange.meet_peers(only_after_collectives=True)
                    if self.trace is not None:
                        self._dispatch.wait_tasks_left_workers()  # the last task's span is recorded too
            finally:
                if self._failure.error is None:
                    self._torn_hook.remove()  # nothing can be torn; the user's module outlives the engine
                self._failure.close()  # cancels the work still queued
                if self._finalizer is not None:
                    self._finalizer.detach()  # leave the finalizer registry: nothing keeps us alive
                self._background.stop(join_timeout_s=None)
                self._exchange.close(clean=self._failure.error is None)
                self._background.release()  # [Note: memory freed at close]
                if self.trace is not None:
                    self._write_trace()
                if self._placement is not None:  # last: a disk failure not raised yet is raised here
                    self._placement.close()  # the disk tier's swap files ([Note: disk tier])

    @property
    def closed(self) -> bool:  # `close()` ran (or the engine was abandoned): it cannot be used any more
        return self._failure.closed

    def save_trace(self, path: str | None = None) -> str:
        """Write the timeline recorded so far (Chrome/Perfetto JSON); needs `trace_path` (env ROUNDPIPE_TRACE)."""
        if self.trace is None:
            raise RuntimeError("no trace is being recorded: set RoundPipeConfig(trace_path=...) or ROUNDPIPE_TRACE.")
        self.synchronize()
        self._dispatch.wait_tasks_left_workers()  # the last task's span is recorded too
        return self._write_trace(path)

    def _write_trace(self, path: str | None = None) -> str:
        written = self.trace.save(path)
        if self._failure.closed:
            self._trace_saver.detach()  # closed: nothing more is recorded, nothing left for the exit
        announce(f"trace written to {written} (open it in https://ui.perfetto.dev)", self.config.resolved_summary)
        return written

    # ------------------------------------------------------------------ checkpoint state (engine_checkpoint.py)

    def engine_state(self) -> dict[str, int]:
        """What a checkpoint needs besides weights and optimizer state for an exact resume: the base seed and pass
        counts of the per-layer RNG streams (dropout masks), where the round-robin dispatch stands and the
        optimizer's step count."""
        return engine_checkpoint.engine_state(self._passes, self._dispatch, self.optimizer)

    def load_engine_state(self, state: dict[str, int]) -> None:
        self.synchronize()
        engine_checkpoint.load_engine_state(state, self._passes, self._dispatch, self.optimizer)

    def load_optimizer_copies(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load full-precision weights (named as in `named_parameters()`) into the optimizer copies, and the
        compute copies from them: unlike `load_state_dict`, nothing is rounded through the compute dtype."""
        self.synchronize()
        engine_checkpoint.load_optimizer_copies(tensors, self.named_parameters(), self._store, self.optimizer)

    def optimizer_copies(self) -> dict[str, torch.Tensor]:
        """The full-precision weights of the trainable parameters (named as in `named_parameters()`), as new host
        tensors, after `synchronize()`: what a checkpoint saves of the optimizer copies, wherever they live."""
        self.synchronize()
        return engine_checkpoint.optimizer_copies(self.named_parameters(), self._store)

    def lagged_weights(self) -> dict[str, torch.Tensor]:
        """With the lagged step, after a look: the compute copies the next training pass computes with (one step
        older than `module`), by bucket index, for a checkpoint ([Note: looking changes nothing])."""
        self.synchronize()
        return engine_checkpoint.lagged_weights(self._store)

    def load_lagged_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore `lagged_weights()` after the model and optimizer were loaded: the next training pass computes
        with them, as the run that saved them would have."""
        self.synchronize()
        engine_checkpoint.load_lagged_weights(tensors, self._store, self.optimizer)

    def schedule(self, num_microbatches: int, mode: Mode | str = Mode.TRAIN) -> list[Task]:
        return self._launch.schedule(num_microbatches, Mode(mode))  # the tasks of a pass, for printing

    def evaluation_schedule(self, num_microbatches: int) -> list[Task]:
        """The tasks of a `model(...)` pass without gradients (evaluation), for printing
        ([Note: one-stage evaluation])."""
        return self._launch.forward_schedule(num_microbatches, keep_for_backward=False)

    def num_microbatches_for(self, rows: int, seq_len: int | None = None) -> int:
        """Micro-batches a training pass over `rows` rows (of `seq_len` tokens) runs now: `num_microbatches`, else
        the measured plan's choice, else the count that fits ([Note: first-pass micro-batches]; twice the device
        count at least, and without `seq_len`); never more than the rows."""
        return self._microbatches.count_for(rows, seq_len)

    # ------------------------------------------------------------------ internals

    @property
    def partition(self) -> Partition:  # the forward and backward stages the next pass runs ([Note: measured plan])
        return self._launch.partition

    def snapshot(self) -> EngineSnapshot:
        """How the engine runs now, as frozen plain data: what telemetry reads (the start summary)."""
        return engine_snapshot(self.config, self.devices, len(self.layers), self.partition, self.optimizer,
                               self._placement, self.data_parallel, self._store, self.summary_notes,
                               self._microbatches.sizing, self._launch.saved_room)

    def _split(self, inputs: tuple, strict: bool = True) -> tuple[int, int, list[tuple]]:
        """The pass's micro-batches, and the partition an unplanned pass of their shape runs
        ([Note: first-pass backward stages]; the sizing is None when `num_microbatches` is set)."""
        split = self._microbatches.split(inputs, strict)
        self._launch.size_unplanned(self._microbatches.sizing)
        return split

    def _before_pass(self, inputs: Any) -> None:
        self.follow_weight_edits()
        self._frozen_edits.follow()  # before this pass's tasks are queued
        if self.optimizer is not None:  # before this pass's commits: [Note: parameters without a gradient]
            self.optimizer.follow_user_grads()
        if self._launch.before_pass():
            self._finalizer = weakref.finalize(self, self._background.abandon)  # stops the threads it started
            note_exit_before_finalizers()  # the finalizer frees no memory at exit
            self._microbatches.size_before_start(inputs)  # the summary says why the first pass has its count
            self._launch.size_unplanned(self._microbatches.sizing)  # and shows the partition it runs
            announce(engine_summary(self.snapshot()), self.config.resolved_summary)

    # ------------------------------------------------------------------ nn.Module behaviour

    def state_dict(self, *args, **kwargs):  # the wrapped module's (compute copies), after `synchronize()`
        self.synchronize()
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load weights into the compute copies and the optimizer copies."""
        if assign:
            raise ValueError("load_state_dict(assign=True) would detach the module from the host store; use "
                             "assign=False.")
        self.synchronize()
        try:
            with engine_checkpoint.loading_compute_copies(self._store, self.optimizer):
                return self.module.load_state_dict(state_dict, strict=strict)
        finally:
            self._weight_edits.record()  # both copies hold what was loaded: nothing to follow


def _weakly(method: Callable[[], None]) -> Callable[[], None]:
    """`method` of an object the caller must not keep alive (the optimizer would the engine)."""
    ref = weakref.WeakMethod(method)

    def call() -> None:
        bound = ref()
        if bound is not None:
            bound()

    return call
