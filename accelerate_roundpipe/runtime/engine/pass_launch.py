"""What every pass of the engine goes through before its tasks are dispatched (the failure check, the measured plan's
re-plan, the workers' start, the adapter setting), its schedule, and the backward pass of a `model(...)` kept for
one ([Note: a pass's plan and results] in runtime/execution/jobs.py)."""

from __future__ import annotations

import torch

from ...config import RoundPipeConfig
from ...plan.partition import Partition
from ...plan.schedule import Mode, Task
from ..common.sync import FailureFlag
from ..execution.adapter_switches import AdapterSwitches
from ..execution.deferred import DeferredCommit, DeferredPasses
from ..execution.dispatch import Dispatcher
from ..execution.jobs import PassPlan, PassResults, SavedInputs
from ..execution.layer_buffers import LayerBuffers
from ..execution.measured_plan import MeasuredPlan
from ..execution.saved_input_room import SavedInputRoom
from ..state.host_store import HostStore
from .engine_checkpoint import PassCounts
from .engine_threads import EngineThreads


class PassLauncher:
    """Owns the partition the next pass runs (the measured plan may replace it before a pass)."""

    def __init__(self, config: RoundPipeConfig, store: HostStore, failure: FailureFlag, partition: Partition,
                 plan: MeasuredPlan, dispatch: Dispatcher, deferred: DeferredPasses, threads: EngineThreads,
                 adapters: AdapterSwitches, passes: PassCounts, buffers: LayerBuffers,
                 saved_room: SavedInputRoom | None = None) -> None:
        self.config, self.store, self.failure, self.partition = config, store, failure, partition
        self.unplanned = partition  # the engine's partition before anything was measured
        self.plan, self.dispatch, self.deferred, self.threads = plan, dispatch, deferred, threads
        self.adapters, self.passes, self.buffers, self.saved_room = adapters, passes, buffers, saved_room

    def schedule(self, num_mb: int, mode: Mode) -> list[Task]:
        return self.dispatch.schedule(self.partition, num_mb, mode)

    def forward_schedule(self, num_mb: int, keep_for_backward: bool) -> list[Task]:
        """The tasks of a `model(...)` pass.

        [Note: one-stage evaluation]
        A forward pass not kept for a backward (evaluation, prediction, generation) runs the training partition's
        stages one after another for nothing when there is one device and every bucket's weights are read from its
        own memory (every bucket at home on the GPU): the stages exist to overlap uploads with compute and to
        spread work over devices, and here nothing crosses and nothing spreads. Each task costs the worker its
        hand-over, allocation, copies and bind (1.5-2 ms of GPU idle at each task's start in a profile of an
        evaluation before training), so such a pass runs as one task over every layer (`Partition.one_stage`): the
        same layers in the same order, the same numbers. Where the measured plan already trains in one stage (the
        168M preset after its first pass) nothing changes (docs/benchmarks.md, "Evaluation in one task"). Its
        weights are all on the device at once, as compute copies: 2 bytes a parameter in bf16, where the device
        holds at least 16 a parameter of those buckets' optimizer state within half its budget
        ([Note: optimizer placement]). A pass kept for a backward keeps the partition: its backward's stages say
        which inputs it saves."""
        partition = self.partition
        devices = self.dispatch.devices
        if not keep_for_backward and len(devices) == 1 and self.store.weights_stay_on(devices[0].device):
            partition = partition.one_stage()
        return self.dispatch.schedule(partition, num_mb, Mode.FORWARD)

    def size_unplanned(self, sizing) -> None:
        """Before an unplanned pass (nothing measured yet: the first, or every pass of a static plan), run the
        partition its sizing chose ([Note: first-pass backward stages]); None or no regrouping: the engine's own."""
        if self.plan.layer_costs is None:
            self.partition = sizing.partition if sizing is not None and sizing.partition is not None \
                else self.unplanned

    def before_pass(self) -> bool:
        """Ready the next pass; True when the workers were started now (its first)."""
        self.failure.check()
        self.deferred.drop_pending()  # a deferred pass never back-propagated ([Note: deferred gradient commit])
        self.partition = self.plan.replan(self.partition, self.failure)
        if self.threads.optimizer is None:
            for bucket in self.store.trainable_buckets:
                if bucket.versions.changed_outside():
                    raise RuntimeError(
                        "the optimizer copies in engine.parameters() were changed outside the engine (an optimizer "
                        "that was not wrapped?). Use `optimizer = engine.wrap_optimizer(optimizer)`: the lagged "
                        "optimizer also writes the compute copies the devices use.")
        self.store.lock_compute_copies_before_first_pass()  # no optimizer placed yet: every bucket crosses
        started = self.dispatch.start_workers(self.passes.seed)
        self.dispatch.forget_finished()
        return started

    def training_pass(self, training: bool, mb_rows: list[int], inputs: tuple, mb_labels: list, loss_fn,
                      loss_weights: list[float], deferred: DeferredCommit | None,
                      num_layers: int) -> tuple[PassPlan, PassResults]:
        """The plan and the results store of the next `forward_backward` pass."""
        saved = self.partition.saved_input_layers(self.config.resolved_recompute, fused=True)
        self._check_saved_room(mb_rows, inputs, saved)
        plan = PassPlan(self.passes.new_pass_index(), Mode.TRAIN, training, tuple(mb_rows), saved,
                        labels=tuple(mb_labels), loss_fn=loss_fn, loss_weights=tuple(loss_weights),
                        keep_limit_bytes=self.plan.allocated_limit(self.plan.keep_limit_bytes),
                        lookahead_limit_bytes=self.plan.allocated_limit(self.plan.lookahead_limit_bytes),
                        input_dtypes=_floating_dtypes(inputs), rng_stream=self.passes.new_rng_stream(training))
        return plan, PassResults(plan.index, num_losses=len(mb_rows), deferred=deferred,
                                 profile=self.plan.profile_for_pass(num_layers))

    def forward_pass(self, training: bool, mb_inputs: list[tuple], inputs: tuple, keep_for_backward: bool,
                     adapter_setting: tuple) -> tuple[PassPlan, PassResults]:
        """The plan and the results store of the next `model(...)` pass; one not kept for a backward (evaluation,
        prediction, generation) reads the newest weights: every step taken, and looking changes nothing."""
        saved = self.partition.saved_input_layers(self.config.resolved_recompute, fused=False) \
            if keep_for_backward else frozenset()
        if keep_for_backward:
            self._check_saved_room([x[0].shape[0] for x in mb_inputs], inputs, saved)
        optimizer = self.threads.optimizer
        if not keep_for_backward and optimizer is not None and optimizer.has_held_steps:
            self.dispatch.wait_inflight()  # nothing may read a compute copy while the look writes it
            optimizer.show_newest()
        plan = PassPlan(self.passes.new_pass_index(), Mode.FORWARD, training, tuple(x[0].shape[0] for x in mb_inputs),
                        saved, keep_limit_bytes=self.plan.allocated_limit(self.plan.keep_limit_bytes),
                        lookahead_limit_bytes=self.plan.allocated_limit(self.plan.lookahead_limit_bytes),
                        input_dtypes=_floating_dtypes(inputs), reads_newest=not keep_for_backward,
                        adapter_setting=adapter_setting, buffer_reading=self.buffers.shown,
                        rng_stream=self.passes.new_rng_stream(training))
        return plan, PassResults(plan.index)

    def _check_saved_room(self, mb_rows: list[int], inputs: tuple, saved: frozenset[int]) -> None:
        if self.saved_room is not None:  # [Note: saved inputs in host memory]
            self.saved_room.check(mb_rows, inputs, saved, self.plan.keep_limit_bytes, self.config.resolved_recompute)

    def follow_user_layers(self, training: bool) -> tuple:
        """What the user set on their layers since the last pass reaches the devices' copies before this one: PEFT's
        switches ([Note: adapter switches]) and the buffers ([Note: layer buffers followed]). Returns the adapter
        setting the pass runs with."""
        setting = self.adapters.check(training)
        self.show_adapter_setting(setting)
        self.follow_layer_buffers()
        return setting

    def follow_layer_buffers(self) -> None:
        """[Note: layer buffers followed]: buffers changed on the user's layers reach the devices' copies."""
        reading = self.buffers.read()
        if self.buffers.needs(reading):
            self.dispatch.wait_inflight()  # the passes in flight run with the copies' old values
            self.buffers.show(reading, self.dispatch.layer_copies())

    def show_adapter_setting(self, setting: tuple) -> None:
        if self.adapters.needs(setting):
            self.dispatch.wait_inflight()  # the passes in flight run with the copies' old setting
            self.adapters.show(setting, self.dispatch.layer_copies())

    def weight_epochs(self) -> list[int]:
        """The weight versions a forward kept for a backward computed with; its backward checks them unchanged."""
        return [b.new_versions_reserved for b in self.store.buckets]

    def backward_pass(self, forward: PassPlan, saved_inputs: SavedInputs, epochs: list[int], grads: tuple) -> None:
        self.failure.check()
        if any(b.new_versions_reserved != e for b, e in zip(self.store.buckets, epochs)):
            raise RuntimeError("weights changed between model(...) and its backward (optimizer.step() ran in "
                               "between), so the recomputation would differ from the forward. Call backward before "
                               "stepping the optimizer.")
        if self.buffers.read() != forward.buffer_reading:  # [Note: layer buffers followed]
            raise RuntimeError("a buffer of the model's layers changed between model(...) and its backward, so the "
                               "recomputation would differ from the forward. Change buffers before the forward or "
                               "after its backward.")
        self.show_adapter_setting(forward.adapter_setting)  # it recomputes with its forward's setting
        rows = list(forward.microbatch_rows)
        split = [torch.split(g, rows, dim=0) if g is not None else [None] * len(rows) for g in grads]
        mb_grads = [tuple(s[m] for s in split) for m in range(len(rows))]
        # The recomputation replays the forward's draws (its RNG stream) from the inputs the forward saved.
        plan = PassPlan(forward.index, Mode.BACKWARD, forward.training, forward.microbatch_rows,
                        forward.saved_layers, input_dtypes=forward.input_dtypes, rng_stream=forward.rng_stream)
        results = PassResults(plan.index, saved_inputs=saved_inputs)
        jobs = self.dispatch.enqueue(self.schedule(len(rows), Mode.BACKWARD), plan, results, mb_grads)
        for job in jobs:
            job.done.get(self.failure)
        self.failure.check()
        self.dispatch.forget_finished()  # checks its results empty ([Note: a pass's plan and results])


def _floating_dtypes(tensors: tuple[torch.Tensor, ...]) -> tuple[torch.dtype, ...]:
    return tuple({t.dtype for t in tensors if t.is_floating_point()})


class PipelineBackward(torch.autograd.Function):
    """Attaches `model(...)` outputs to the backward pipeline."""

    @staticmethod
    def forward(ctx, engine, launcher: PassLauncher, plan: PassPlan, saved_inputs: SavedInputs, epochs: list[int],
                anchor: torch.Tensor, *outputs: torch.Tensor):
        ctx.engine = engine  # kept alive (its threads running) while a graph may still call this backward
        ctx.launcher, ctx.plan, ctx.saved_inputs, ctx.epochs = launcher, plan, saved_inputs, epochs
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*[o for o in outputs if not o.is_floating_point()])
        return tuple(o.view_as(o) for o in outputs)

    @staticmethod
    def backward(ctx, *grads):
        saved_inputs, ctx.saved_inputs = ctx.saved_inputs, None  # read once, by this backward
        ctx.launcher.backward_pass(ctx.plan, saved_inputs, ctx.epochs, grads)
        return (None,) * 6 + (None,) * len(grads)
