"""Optimizer state on the device (issue 26): where each trainable bucket's optimizer copy, gradient and state live
("host", "device", or a budget that places some), and float64 parity with plain PyTorch for every placement: AdamW
with clipping and gradient accumulation, exact and lagged, resume across placements, and looking changes nothing.

On CPU workers a bucket placed "on the device" lives in separate (non-pinned) tensors on the CPU and takes the
device code path; with the lagged step (`async_optimizer=True`) such a bucket still steps exactly, only the host's
buckets lag, so the lagged reference is per bucket.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

from accelerate_roundpipe import RoundPipe, RoundPipeConfig

from toy_models import batch, plain_adamw_training, run_layers, tied_model

LR = 1e-2
WEIGHT_DECAY = 0.1
MAX_NORM = 3.0  # the exact run's norms are about 4.8, 3.6 (clipped), 2.6 and 1.5 (not)
STEPS = 4
ACCUMULATION = 2  # forward_backward passes per optimizer step
TOL = dict(rtol=1e-12, atol=1e-12)
MIXED_ON_DEVICE = 3  # buckets the mixed budget holds (the lowest layers: layer 0's bias, the tied weight, layer 1)


def _batches(steps: int = STEPS) -> list[list[tuple]]:
    return [[batch(rows=8, seed=10 * step + j) for j in range(ACCUMULATION)] for step in range(steps)]


def _snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def _config(placement: str, budget: float | None = None, lagged: bool = False) -> RoundPipeConfig:
    return RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=2, async_optimizer=lagged, summary=False,
                           optimizer_placement=placement, optimizer_device_budget=budget)


def _bucket_bytes(bucket) -> int:
    """What placing a bucket costs: master copy, gradient, the spare gradient buffer and AdamW's two moments, in the
    optimizer dtype."""
    return bucket.optim.numel() * bucket.optim.element_size() * 5


@functools.cache
def _mixed_budget() -> tuple[float, tuple[int, ...], frozenset[str]]:
    """A budget (GiB) holding the MIXED_ON_DEVICE lowest buckets with room to spare for less than the smallest one,
    so it places those and no more whether the placer stops at the first bucket that does not fit or skips it; the
    indices of those buckets and the names of their parameters."""
    engine = RoundPipe(tied_model(), _config("host"))
    try:
        order = sorted(engine.host_store.trainable_buckets, key=lambda b: (min(b.layers), b.index))
        sizes = [_bucket_bytes(b) for b in order]
        budget = sum(sizes[:MIXED_ON_DEVICE]) + min(sizes) // 2
        placed = order[:MIXED_ON_DEVICE]
        names = frozenset(slot.name for b in placed for slot in b.slots)
        return budget / 2**30, tuple(sorted(b.index for b in placed)), names
    finally:
        engine.close()


def _placement_config(placement: str, lagged: bool = False) -> RoundPipeConfig:
    """"mixed": the device placement under the budget of `_mixed_budget`."""
    if placement == "mixed":
        return _config("device", _mixed_budget()[0], lagged)
    return _config(placement, None, lagged)


def _fresh_names(engine: RoundPipe) -> set[str]:
    """Names of the parameters whose buckets live on a device (they never lag)."""
    store = engine.host_store
    return {slot.name for i in engine.optimizer_placement.device_buckets for slot in store.buckets[i].slots}


def _all_names() -> set[str]:
    return {name for name, _ in tied_model().named_parameters()}


def _expected_on_device(engine: RoundPipe, placement: str) -> list[int]:
    trainable = sorted(b.index for b in engine.host_store.trainable_buckets)
    return {"host": [], "auto": [], "device": trainable, "mixed": list(_mixed_budget()[1])}[placement]


def _expected_fresh(placement: str) -> set[str]:
    """The parameters a placement puts on a device, as the settings say (the engine's own answer is checked
    against this)."""
    return {"host": set(), "device": _all_names(), "mixed": set(_mixed_budget()[2])}[placement]


def plain_training(batches, lagged: bool = False, fresh: set[str] = frozenset()):
    """Plain PyTorch AdamW on the tied model, clipped to MAX_NORM (`toy_models.plain_adamw_training`: exact, or
    lagged except the parameters in `fresh`, the device buckets')."""
    return plain_adamw_training(tied_model, batches, MAX_NORM, LR, WEIGHT_DECAY, lagged, fresh)


def _build(config: RoundPipeConfig):
    engine = RoundPipe(tied_model(), config)
    optimizer = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=LR, weight_decay=WEIGHT_DECAY))
    return engine, optimizer


def _train(engine, optimizer, batches, look_every_step: bool = True, after_step=None):
    """Steps of accumulated, clipped AdamW; the norms, the passes' losses and (when looking) the weights after each
    step as `engine.module` shows them after a synchronize. `after_step()` runs between a step and its zero_grad."""
    norms, losses, weights = [], [], []
    for passes in batches:
        for x, mask, y in passes:
            losses.append(engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy))
        norms.append(float(optimizer.clip_grad_norm_(MAX_NORM)))
        optimizer.step()
        if after_step is not None:
            after_step()
        optimizer.zero_grad()
        if look_every_step:
            engine.synchronize()
            weights.append(_snapshot(engine.module))
    return norms, [float(loss) for loss in losses], weights


def _assert_same_run(norms, weights, ref_norms, ref_weights) -> None:
    assert len(weights) == len(ref_weights)
    torch.testing.assert_close(norms, ref_norms, **TOL)
    for step, (ours, theirs) in enumerate(zip(weights, ref_weights)):
        assert ours.keys() == theirs.keys()
        for name, tensor in theirs.items():
            assert ours[name].dtype == torch.float64
            torch.testing.assert_close(ours[name], tensor, **TOL, msg=lambda m, s=step, n=name: f"step {s}, {n}: {m}")


def _assert_placed(engine: RoundPipe, expected_on_device: list[int]) -> None:
    """The placement lists and every bucket's `.home` agree with `expected_on_device`."""
    placement = engine.optimizer_placement
    trainable = sorted(b.index for b in engine.host_store.trainable_buckets)
    assert sorted(placement.device_buckets) == expected_on_device
    assert sorted(placement.host_buckets) == [i for i in trainable if i not in expected_on_device]
    for bucket in engine.host_store.trainable_buckets:
        if bucket.index in expected_on_device:
            assert isinstance(bucket.home, torch.device) and bucket.home.type == "cpu", (bucket.index, bucket.home)
        else:
            assert bucket.home is None, (bucket.index, bucket.home)


@pytest.mark.parametrize("placement", ["host", "auto", "device", "mixed"])
def test_buckets_are_placed_as_asked(placement):
    """"host" and "auto" (on CPU workers) keep every bucket on the host; "device" with no budget places every one
    (no limit on CPU workers); a budget places the lowest layers' buckets first (layer 0's bias, the tied
    embedding, layer 1) and the rest stay on the host. The placement prints as a table."""
    engine, _ = _build(_placement_config(placement))
    try:
        _assert_placed(engine, _expected_on_device(engine, placement))
        if placement == "mixed":
            placement_object = engine.optimizer_placement
            assert placement_object.device_buckets and placement_object.host_buckets  # really mixed
            table = str(placement_object)
            assert table.strip() and "host" in table.lower()
    finally:
        engine.close()


def test_the_environment_variables_choose_the_placement(monkeypatch):
    budget, expected, _ = _mixed_budget()
    monkeypatch.setenv("ROUNDPIPE_OPTIMIZER_PLACEMENT", "device")
    monkeypatch.setenv("ROUNDPIPE_OPTIMIZER_DEVICE_BUDGET", repr(budget))
    engine = RoundPipe(tied_model(), RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=2, summary=False))
    engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=LR))
    try:
        _assert_placed(engine, list(expected))
    finally:
        engine.close()


@pytest.mark.parametrize("placement", ["host", "device", "mixed"])
def test_exact_steps_equal_plain_torch(placement):
    batches = _batches()
    ref_norms, ref_weights = plain_training(batches)
    assert any(n > MAX_NORM for n in ref_norms) and any(n < MAX_NORM for n in ref_norms)  # clipped and not
    engine, optimizer = _build(_placement_config(placement))
    try:
        _assert_placed(engine, _expected_on_device(engine, placement))
        norms, _, weights = _train(engine, optimizer, batches)
        _assert_same_run(norms, weights, ref_norms, ref_weights)
        # The optimizer copies (what the optimizer steps, wherever they live) hold the same newest weights.
        optim_copies = _snapshot(engine)
        for name, tensor in ref_weights[-1].items():
            torch.testing.assert_close(optim_copies[name], tensor, **TOL, msg=name)
    finally:
        engine.close()


@pytest.mark.parametrize("placement", ["host", "device", "mixed"])
def test_lagged_steps_lag_only_the_hosts_buckets(placement):
    """async_optimizer=True: all on the host is the staleness-1 reference, all on the device the exact one, and a
    mixed placement computes with the newest weights for device buckets and the weights one step older for the
    host's (in every pass of the iteration: see `plain_training`)."""
    batches = _batches()
    engine, optimizer = _build(_placement_config(placement, lagged=True))
    try:
        _assert_placed(engine, _expected_on_device(engine, placement))
        fresh = _expected_fresh(placement)
        assert _fresh_names(engine) == fresh
        if placement == "mixed":
            assert fresh != _all_names() and "0.linear.weight" in fresh  # mixed, the tied embedding on the device
        ref_norms, ref_weights = plain_training(batches, lagged=True, fresh=fresh)
        norms, _, weights = _train(engine, optimizer, batches)
        _assert_same_run(norms, weights, ref_norms, ref_weights)
    finally:
        engine.close()


def test_the_three_lagged_references_differ():
    """Guard for the test above: staleness 1 everywhere, nowhere and for the host's buckets only give different
    weights, so each case pins its own rule."""
    batches = _batches(3)
    runs = [plain_training(batches, lagged=True, fresh=_expected_fresh(placement))[1][-1]
            for placement in ("host", "device", "mixed")]
    for i in range(len(runs)):
        for j in range(i + 1, len(runs)):
            assert not torch.allclose(runs[i]["4.linear.weight"], runs[j]["4.linear.weight"], rtol=1e-6), (i, j)


@pytest.mark.parametrize("before, after", [("device", "host"), ("host", "device"), ("mixed", "device")])
def test_resume_across_placements_repeats_the_uninterrupted_run(before, after):
    """Two steps with one placement, its weights, engine state and optimizer state loaded into a fresh engine with
    another placement, two more steps: the four steps of plain torch."""
    batches = _batches()
    ref_norms, ref_weights = plain_training(batches)
    first, optimizer = _build(_placement_config(before))
    try:
        _train(first, optimizer, batches[:2], look_every_step=False)
        weights = copy.deepcopy(first.state_dict())  # synchronizes
        optimizer_state = copy.deepcopy(optimizer.state_dict())
        engine_state = first.engine_state()
    finally:
        first.close()
    assert optimizer_state["state"]  # AdamW's moments travel
    for name, tensor in ref_weights[1].items():
        torch.testing.assert_close(weights[name], tensor, **TOL, msg=name)

    resumed, optimizer = _build(_placement_config(after))
    try:
        resumed.load_state_dict(weights)
        resumed.load_engine_state(engine_state)
        optimizer.load_state_dict(optimizer_state)
        norms, _, weights_after = _train(resumed, optimizer, batches[2:])
        _assert_same_run(norms, weights_after, ref_norms[2:], ref_weights[2:])
    finally:
        resumed.close()


LOOK_AFTER = 1  # the step after which the looking run evaluates and reads the weights


def _looking_run(placement: str, lagged: bool, look: bool):
    engine, optimizer = _build(_placement_config(placement, lagged))
    losses, looked = [], None
    try:
        for step, passes in enumerate(_batches()):
            _, step_losses, _ = _train(engine, optimizer, [passes], look_every_step=False)
            losses += step_losses
            if look and step == LOOK_AFTER:
                x_eval, mask_eval, _ = batch(rows=5, seed=100)
                with torch.no_grad():
                    first = engine(x_eval, mask_eval)  # an evaluation with no synchronize before it
                    second = engine(x_eval, mask_eval)
                state = copy.deepcopy(engine.state_dict())  # a checkpoint's look
                module_weights = _snapshot(engine.module)
                looked = (first, second, state, module_weights)
        engine.synchronize()
        assert _fresh_names(engine) == _expected_fresh(placement)
        return losses, _snapshot(engine.module), looked
    finally:
        engine.close()


@pytest.mark.parametrize("placement, lagged", [("device", False), ("device", True), ("mixed", True)])
def test_looking_changes_nothing(placement, lagged):
    """Evaluating, reading the state dict and the module between steps show the newest weights (every step taken,
    host buckets' lagged ones included), the same answer twice, and leave the trajectory bit for bit unchanged."""
    losses, final, _ = _looking_run(placement, lagged, look=False)
    looked_losses, looked_final, looked = _looking_run(placement, lagged, look=True)
    assert looked_losses == losses
    for name, tensor in final.items():
        assert torch.equal(looked_final[name], tensor), name
    first, second, state, module_weights = looked
    _, ref_weights = plain_training(_batches(), lagged=lagged, fresh=_expected_fresh(placement))
    newest = ref_weights[LOOK_AFTER]  # the weights after steps 0..LOOK_AFTER, all taken
    for name, tensor in newest.items():
        torch.testing.assert_close(state[name], tensor, **TOL, msg=name)
        torch.testing.assert_close(module_weights[name], tensor, **TOL, msg=name)
    assert torch.equal(first, second)
    plain = tied_model()
    plain.load_state_dict(state)
    x_eval, mask_eval, _ = batch(rows=5, seed=100)
    with torch.no_grad():
        torch.testing.assert_close(first, run_layers(plain, (x_eval, mask_eval)), **TOL)


def test_an_unknown_placement_is_refused_naming_the_field_and_the_choices(monkeypatch):
    with pytest.raises(ValueError, match="optimizer_placement") as refused:
        RoundPipeConfig(optimizer_placement="gpu")
    assert all(choice in str(refused.value) for choice in ("'auto'", "'host'", "'device'"))
    monkeypatch.setenv("ROUNDPIPE_OPTIMIZER_PLACEMENT", "gpu")
    with pytest.raises(ValueError, match="ROUNDPIPE_OPTIMIZER_PLACEMENT"):
        RoundPipeConfig()


@pytest.mark.parametrize("budget", [-1, -0.5, "-2GiB", float("nan"), "lots"])
def test_a_bad_device_budget_is_refused(budget):
    with pytest.raises(ValueError, match="optimizer_device_budget"):
        RoundPipeConfig(optimizer_device_budget=budget)


def test_settings_as_given_in_text(monkeypatch):
    monkeypatch.delenv("ROUNDPIPE_OPTIMIZER_PLACEMENT", raising=False)
    monkeypatch.delenv("ROUNDPIPE_OPTIMIZER_DEVICE_BUDGET", raising=False)
    assert RoundPipeConfig().resolved_optimizer_placement == "auto"
    config = RoundPipeConfig(optimizer_placement=" Device ", optimizer_device_budget="2GiB")
    assert config.optimizer_placement == "device" and config.optimizer_device_budget == 2.0
    monkeypatch.setenv("ROUNDPIPE_OPTIMIZER_PLACEMENT", "host")
    monkeypatch.setenv("ROUNDPIPE_OPTIMIZER_DEVICE_BUDGET", "0.5")
    config = RoundPipeConfig()
    assert config.optimizer_placement == "host" and config.optimizer_device_budget == 0.5
    assert RoundPipeConfig(optimizer_placement="device").optimizer_placement == "device"  # the argument wins


class _NotElementwiseAdamW(torch.optim.AdamW):
    """AdamW under another class: RoundPipe cannot know its update is per tensor, so it never steps buckets in one
    call ([Note: device steps in one call])."""


@pytest.mark.parametrize("optimizer_class, calls_per_step", [(torch.optim.AdamW, 1), (_NotElementwiseAdamW, None)])
def test_device_buckets_ready_together_step_in_one_call(optimizer_class, calls_per_step):
    """With clipping every device bucket's gradients are final at once: an element-wise optimizer steps them in one
    call (its step hooks run once a step); another class is stepped bucket by bucket, as on the host; both give
    plain torch's weights."""
    engine = RoundPipe(tied_model(), _config("device"))
    inner = optimizer_class(engine.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    calls: list[int] = []
    inner.register_step_pre_hook(lambda optimizer, args, kwargs: calls.append(1))
    optimizer = engine.wrap_optimizer(inner)
    try:
        buckets = len(engine.optimizer_placement.device_buckets)
        assert buckets > 1
        batches = _batches()
        for passes in batches:
            for x, mask, y in passes:
                engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy)
            optimizer.clip_grad_norm_(MAX_NORM)
            optimizer.step()
            optimizer.zero_grad()
        engine.synchronize()
        assert len(calls) == STEPS * (calls_per_step or buckets)
        _, ref_weights = plain_training(batches)
        for name, p in engine.module.named_parameters():
            torch.testing.assert_close(p.detach(), ref_weights[-1][name], **TOL, msg=name)
    finally:
        engine.close()


def _one_device_run(monkeypatch, cut_always: bool,
                    microbatches: int = 1) -> tuple[int, int, object, dict[str, torch.Tensor]]:
    """Three clipped AdamW steps on one CPU worker with every bucket on the device and the measured plan (after the
    measured pass one fused task holds all layers but the bottom one); the number of passes, of the workers'
    autograd calls, the partition of the passes after the measured one, and the weights at the end."""
    from accelerate_roundpipe.runtime.execution import worker as worker_module

    backward_calls: list[int] = []
    real_backward = worker_module._backward

    def counting_backward(outputs, grads):
        backward_calls.append(1)
        real_backward(outputs, grads)

    monkeypatch.setattr(worker_module, "_backward", counting_backward)
    if cut_always:
        monkeypatch.setattr(worker_module.Worker, "_one_backward", lambda self, job: False)
    config = RoundPipeConfig(devices=["cpu"], num_microbatches=microbatches, plan="measured", summary=False,
                             optimizer_placement="device")
    engine, optimizer = _build(config)
    try:
        batches = _batches(3)
        _train(engine, optimizer, batches, look_every_step=False)
        engine.synchronize()
        return sum(map(len, batches)), len(backward_calls), engine.partition, _snapshot(engine.module)
    finally:
        engine.close()


@pytest.mark.parametrize("microbatches", [1, 2])
def test_a_fused_task_of_device_buckets_goes_back_in_one_autograd_call(monkeypatch, microbatches):
    """[Note: one backward for device gradients]: once the measured pass (cut layer by layer, to time each) is
    done, the one fused task whose buckets all live on the device runs one backward, not one per layer, and the
    weights are bitwise those of the layer-by-layer backward."""
    passes, calls, partition, weights = _one_device_run(monkeypatch, cut_always=False, microbatches=microbatches)
    layers = len(tied_model())
    fused = partition.fused
    assert len(fused.layers) > 1 and fused.start > 0, partition  # its input gradients go back to layer 0's task
    # the measured pass goes back layer by layer; after it the fused task once, the backward tasks layer by layer,
    # each per micro-batch
    assert calls == microbatches * (layers + (passes - 1) * (1 + layers - len(fused.layers))), (calls, partition)
    passes, cut_calls, _, cut_weights = _one_device_run(monkeypatch, cut_always=True, microbatches=microbatches)
    assert cut_calls == microbatches * layers * passes
    for name, tensor in cut_weights.items():
        assert torch.equal(weights[name], tensor), name


def test_device_gradient_buffers_alternate_between_two_and_keep_their_views():
    """[Note: device gradient buffers reused]: a device bucket's gradient is one of two buffers, step after step
    (no new allocation, no new `.grad` views), and the run still equals plain torch."""
    engine, optimizer = _build(_config("device"))
    try:
        buckets = [engine.host_store.buckets[i] for i in engine.optimizer_placement.device_buckets]
        # the objects themselves are kept: an id or an address freed and reused would pass for the same buffer
        buffers = {b.index: {} for b in buckets}
        views = {b.index: {} for b in buckets}
        def record() -> None:
            engine.synchronize()
            for b in buckets:
                buffers[b.index][id(b.grad)] = b.grad
                views[b.index].update((id(slot.optim.grad), slot.optim.grad) for slot in b.slots)

        batches = _batches(6)
        _train(engine, optimizer, batches, look_every_step=False, after_step=record)
        for b in buckets:
            assert len(buffers[b.index]) == 2, (b.index, buffers[b.index])
            assert len(views[b.index]) == 2 * len(b.slots), b.index
        _, ref_weights = plain_training(batches)
        for name, p in engine.module.named_parameters():
            torch.testing.assert_close(p.detach(), ref_weights[-1][name], **TOL, msg=name)
    finally:
        engine.close()
