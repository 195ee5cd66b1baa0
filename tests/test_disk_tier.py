"""The disk as a third tier of optimizer state (issue 33 items 3 and 4): buckets past `host_memory_budget` keep their
optimizer copy and state in swap files under `offload_dir` ([Note: disk tier]). Float64 parity with plain PyTorch
for every mix of tiers (host and disk, device and host and disk, all on disk) with clipping, accumulation, a
scheduler, frozen and tied parameters; resume across tiers bit for bit; the state out of memory between steps; the
files removed at close(); the settings refused before training; the start summary and the trace.

The lagged step lags a disk bucket as a host bucket ([Note: disk tier]).
"""

from __future__ import annotations

import copy
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from test_optimizer_placement import LR, TOL, WEIGHT_DECAY, _assert_same_run
from torch import nn

from accelerate_roundpipe import RoundPipe, RoundPipeConfig
from accelerate_roundpipe.config import SettingError
from accelerate_roundpipe.runtime.disk import OffloadSettingError, folder_checks
from accelerate_roundpipe.runtime.disk.swap_folder import PREFIX
from accelerate_roundpipe.runtime.state import disk_tier
from accelerate_roundpipe.runtime.state.disk_tier import DiskTier, host_state_bytes, layout_of

from toy_models import Block, Embed, Head, Merge, Split, plain_adamw_training, run_layers

GiB = 2**30
NAMES = ("exp_avg", "exp_avg_sq")
# Wide enough that a bucket's state outweighs the 4 KiB alignment of its file and the staging's three slots, so that
# a budget can put some buckets on disk and not others (with 6-wide layers any disk bucket costs more than it frees).
WIDTH = 48
MAX_NORM = 5.7  # the reference's norms are about 5.2 (not clipped), 6.1, 6.0 (clipped) and 5.4 (not)
STEPS = 4
ACCUMULATION = 2


def wide_model(frozen_block: bool = False) -> nn.Sequential:
    """toy_models.tied_model's layers at WIDTH: 9 layers in float64, the first and the last sharing one weight."""
    torch.manual_seed(0)
    first, last = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
    last.weight = first.weight
    blocks = [Block(WIDTH) for _ in range(5)]
    model = nn.Sequential(Embed(first), blocks[0], Split(WIDTH), Merge(), *blocks[1:], Head(last)).double()
    if frozen_block:
        for p in model[4].parameters():
            p.requires_grad_(False)
    return model


def _batch(seed: int, rows: int = 8):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, WIDTH, generator=gen, dtype=torch.float64)
    mask = (torch.rand(rows, generator=gen) > 0.2).long()
    return x, mask, torch.randint(0, WIDTH, (rows,), generator=gen)


def _batches(steps: int = STEPS) -> list[list[tuple]]:
    return [[_batch(10 * step + j) for j in range(ACCUMULATION)] for step in range(steps)]


def plain_training(batches, max_norm: float = MAX_NORM, lagged: bool = False,
                   fresh: frozenset[str] = frozenset()):
    """Plain PyTorch AdamW on `wide_model()` (`toy_models.plain_adamw_training`): each step's passes accumulated,
    clipped to `max_norm`; lagged except the parameters in `fresh` (device buckets step exactly:
    [Note: device steps are exact]), as test_optimizer_placement's reference."""
    return plain_adamw_training(wide_model, batches, max_norm, LR, WEIGHT_DECAY, lagged, fresh)


def _train(engine, optimizer, batches, look_every_step: bool = True):
    norms, losses, weights = [], [], []
    for passes in batches:
        for x, mask, y in passes:
            losses.append(engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy))
        norms.append(float(optimizer.clip_grad_norm_(MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        if look_every_step:
            engine.synchronize()
            weights.append({name: p.detach().clone() for name, p in engine.module.named_parameters()})
    return norms, [float(loss) for loss in losses], weights


def _config(tmp_path, budget_gib: float | None, placement: str = "host", device_budget: float | None = None,
            **more) -> RoundPipeConfig:
    return RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=2, summary=False, optimizer_placement=placement,
                           optimizer_device_budget=device_budget, host_memory_budget=budget_gib,
                           offload_dir=str(tmp_path / "offload"), **more)


def _bottom(k: int) -> tuple[float, frozenset[int]]:
    """An optimizer_device_budget (GiB) placing the `k` lowest buckets on the device, and their indices."""
    engine = RoundPipe(wide_model(), RoundPipeConfig(devices=["cpu", "cpu"], summary=False))
    try:
        order = sorted(engine.host_store.trainable_buckets, key=lambda b: (min(b.layers), b.index))
        sizes = [b.optim.numel() * b.optim.element_size() * 5 for b in order]
        return (sum(sizes[:k]) + min(sizes) // 2) / GiB, frozenset(b.index for b in order[:k])
    finally:
        engine.close()


def _budget_for_top(k: int, on_device: frozenset[int] = frozenset()) -> tuple[float, list[int]]:
    """A host budget (GiB) under which the `k` top buckets of those not on a device go to disk and no more, and
    their indices: the store's host bytes with them on disk and their staging, plus a little."""
    engine = RoundPipe(wide_model(), RoundPipeConfig(devices=["cpu", "cpu"], summary=False))
    try:
        store = engine.host_store
        fixed = sum(b.compute.numel() * b.compute.element_size() for b in store.buckets)
        host = [b for b in store.trainable_buckets if b.index not in on_device]
        top = sorted(host, key=lambda b: (-min(b.layers), -b.index))[:k]
        kept = sum(host_state_bytes(b, 2) for b in host if b not in top)
        grads = sum(b.optim.numel() * b.optim.element_size() for b in top)
        staging = min(3, k) * max((layout_of(b, NAMES).nbytes for b in top), default=0)
        return (fixed + kept + grads + staging + 8) / GiB, sorted(b.index for b in top)
    finally:
        engine.close()


def _build(config: RoundPipeConfig, optimizer_class=torch.optim.AdamW, frozen_block: bool = False, **kwargs):
    engine = RoundPipe(wide_model(frozen_block), config)
    kwargs = kwargs or dict(lr=LR, weight_decay=WEIGHT_DECAY)
    params = [p for p in engine.parameters() if p.requires_grad]
    return engine, engine.wrap_optimizer(optimizer_class(params, **kwargs))


MIXES = {
    "host+disk": lambda: (_budget_for_top(5), "host", None),
    "all disk": lambda: ((1e-9, None), "host", None),
    "device+host+disk": lambda: (_budget_for_top(5, _bottom(3)[1]), "device", _bottom(3)[0]),
}


def _mix(tmp_path, mix: str, **more):
    (budget, expected), placement, device_budget = MIXES[mix]()
    config = _config(tmp_path, budget, placement, device_budget, **more)
    return config, expected


def _swap_folders(tmp_path) -> list[str]:
    folder = tmp_path / "offload"
    return sorted(n for n in os.listdir(folder) if n.startswith(PREFIX)) if folder.exists() else []


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_exact_steps_equal_plain_torch_for_every_mix_of_tiers(tmp_path, mix):
    """AdamW, clipped (some steps clipped, some not), two passes accumulated per step, the tied weight shared by the
    first and last layer: the weights after every step are plain torch's, whichever tier each bucket is in."""
    config, expected = _mix(tmp_path, mix)
    batches = _batches()
    ref_norms, ref_weights = plain_training(batches)
    engine, optimizer = _build(config)
    try:
        placement = engine.optimizer_placement
        trainable = sorted(b.index for b in engine.host_store.trainable_buckets)
        assert placement.disk_buckets == (expected if expected is not None else trainable)
        if mix == "device+host+disk":
            assert placement.device_buckets and placement.host_buckets  # really three tiers
        if mix == "host+disk":
            assert placement.host_buckets and not placement.device_buckets
        for index in placement.disk_buckets:
            assert isinstance(engine.host_store.buckets[index].tier, DiskTier)
        norms, _, weights = _train(engine, optimizer, batches)
        _assert_same_run(norms, weights, ref_norms, ref_weights)
        copies = engine.optimizer_copies()  # read from the files for the disk's buckets
        for name, tensor in ref_weights[-1].items():
            torch.testing.assert_close(copies[name], tensor, **TOL, msg=name)
    finally:
        engine.close()
    assert _swap_folders(tmp_path) == []  # close() removed the swap files


def test_a_disk_buckets_state_is_not_in_memory_between_steps(tmp_path):
    """After a step, the optimizer's state of a disk bucket's parameter holds only AdamW's `step`, its optimizer
    copy is a stand-in of no memory (zero strides), and its file holds what a state dict shows."""
    config, expected = _mix(tmp_path, "host+disk")
    engine, optimizer = _build(config)
    try:
        _train(engine, optimizer, _batches(2), look_every_step=False)
        engine.synchronize()
        store = engine.host_store
        for bucket in store.trainable_buckets:
            for slot in bucket.slots:
                entry = optimizer.state[slot.optim]
                if bucket.index in expected:
                    assert set(entry) == {"step"}, (bucket.index, set(entry))
                    assert slot.optim.stride() == (0,) * slot.optim.dim() or slot.optim.numel() <= 1
                    assert bucket.optim.stride() == (0,)
                else:
                    assert set(entry) == {"step", *NAMES}
        state = optimizer.state_dict()["state"]
        assert all(set(entry) == {"step", *NAMES} for entry in state.values()) and len(state) == len(
            list(engine.parameters()))
        assert all(set(optimizer.state[slot.optim]) == {"step"} for i in expected for slot in store.buckets[i].slots)
    finally:
        engine.close()


def _plain_frozen_run(batches, optimizer_class, kwargs):
    model = wide_model(frozen_block=True)
    optimizer = optimizer_class([p for p in model.parameters() if p.requires_grad], **kwargs)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    weights = []
    for passes in batches:
        for x, mask, y in passes:
            (nn.functional.cross_entropy(run_layers(model, (x, mask)), y) / len(passes)).backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        weights.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return weights


@pytest.mark.parametrize("optimizer_class, kwargs, mixed", [
    (torch.optim.AdamW, dict(lr=LR, weight_decay=WEIGHT_DECAY, amsgrad=True), True),
    (torch.optim.SGD, dict(lr=LR, momentum=0.9), False),
])
def test_frozen_parameters_a_scheduler_and_other_state_on_disk(tmp_path, optimizer_class, kwargs, mixed):
    """A frozen block, an LR scheduler, loss scaled by the accumulation, AdamW with amsgrad's third state (the host
    and the disk mixed) and SGD's momentum (all on disk): training is plain torch's."""
    batches = _batches()
    ref = _plain_frozen_run(batches, optimizer_class, kwargs)
    budget = _budget_for_top(5)[0] * 0.9 if mixed else 1e-9
    engine, optimizer = _build(_config(tmp_path, budget), optimizer_class, True, **kwargs)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    try:
        placement = engine.optimizer_placement
        assert placement.disk_buckets and bool(placement.host_buckets) == mixed

        def scaled_loss(out, target):
            return nn.functional.cross_entropy(out, target) / ACCUMULATION

        for step, passes in enumerate(batches):
            for x, mask, y in passes:
                engine.forward_backward(x, mask, labels=y, loss_fn=scaled_loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            engine.synchronize()
            for name, p in engine.module.named_parameters():
                torch.testing.assert_close(p.detach(), ref[step][name], **TOL, msg=f"step {step}, {name}")
    finally:
        engine.close()


def _train_and_save(config, batches, steps: int, param_dtype=None):
    engine, optimizer = _build(config)
    try:
        _train(engine, optimizer, batches[:steps], look_every_step=False)
        buffer = io.BytesIO()
        torch.save({"model": engine.state_dict(), "optimizer": optimizer.state_dict(),
                    "copies": engine.optimizer_copies(), "engine": engine.engine_state()}, buffer)
        return buffer.getvalue()
    finally:
        engine.close()


def _resume_and_train(config, saved: bytes, batches):
    checkpoint = torch.load(io.BytesIO(saved), weights_only=True)
    engine, optimizer = _build(config)
    try:
        engine.load_state_dict(checkpoint["model"])
        engine.load_optimizer_copies(checkpoint["copies"])
        engine.load_engine_state(checkpoint["engine"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        norms, losses, _ = _train(engine, optimizer, batches, look_every_step=False)
        return norms, losses, engine.optimizer_copies(), copy.deepcopy(optimizer.state_dict())
    finally:
        engine.close()


@pytest.mark.parametrize("param_dtype", [None, torch.float32])
@pytest.mark.parametrize("before, after", [("all disk", "host"), ("host", "all disk"), ("host+disk", "all disk")])
def test_resume_across_tiers_is_bitwise(tmp_path, before, after, param_dtype):
    """Two steps under one mix of tiers, saved (the module, the optimizer's state dict through torch.save, the
    optimizer copies, the engine state), loaded under another mix, two more steps: bit for bit the four steps of
    an uninterrupted run, float64 throughout or float32 compute copies beside float64 optimizer copies."""
    dtypes = dict(param_dtype=param_dtype, optimizer_dtype=torch.float64 if param_dtype is not None else None)

    def config(mix):
        if mix == "host":
            return _config(tmp_path, None, **dtypes)
        return _mix(tmp_path, mix, **dtypes)[0]

    batches = [[(x.to(param_dtype or x.dtype), mask, y) for x, mask, y in passes] for passes in _batches()]
    whole = _resume_and_train(config("host"), _train_and_save(config("host"), batches, 0), batches)
    saved = _train_and_save(config(before), batches, 2)
    resumed = _resume_and_train(config(after), saved, batches[2:])
    assert resumed[0] == whole[0][2:] and resumed[1] == whole[1][4:]  # norms, losses
    for name, tensor in whole[2].items():
        assert torch.equal(resumed[2][name], tensor), name
    for index, entry in whole[3]["state"].items():
        for key, value in entry.items():
            assert torch.equal(resumed[3]["state"][index][key], value), (index, key)


def test_close_removes_the_files_and_everything_fitting_makes_no_folder(tmp_path):
    engine, _ = _build(_config(tmp_path, None))  # the default budget: this machine's memory, far above the model
    try:
        assert engine.optimizer_placement.disk_buckets == []
        assert not (tmp_path / "offload").exists()
    finally:
        engine.close()
    engine, _ = _build(_config(tmp_path, 1e-9))
    try:
        (folder,) = _swap_folders(tmp_path)
        files = os.listdir(tmp_path / "offload" / folder)
        assert sum(f.endswith(".swap") for f in files) == len(engine.optimizer_placement.disk_buckets) > 0
    finally:
        engine.close()
    assert _swap_folders(tmp_path) == []


CHILD = textwrap.dedent("""
    import os, sys, time, torch
    from torch import nn
    sys.path.insert(0, {tests!r})
    from accelerate_roundpipe import RoundPipe, RoundPipeConfig
    from accelerate_roundpipe.runtime.common import faults
    from test_disk_tier import _batch as batch, wide_model as tied_model
    config = RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=2, summary=False, host_memory_budget=1e-9,
                             offload_dir={offload!r})
    engine = RoundPipe(tied_model(), config)
    optimizer = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-2))
    def step(seed):
        x, mask, y = batch(seed)
        engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy)
        optimizer.step()
        optimizer.zero_grad()
    step(0)
    torch.save({{"model": engine.state_dict(), "optimizer": optimizer.state_dict()}}, {checkpoint!r} + ".tmp")
    os.replace({checkpoint!r} + ".tmp", {checkpoint!r})
    seen = []
    def stall(point):  # the second bucket of the step: the first one stepped, its write-back in flight
        if point == "optimizer.step":
            seen.append(point)
            if len(seen) == 2:
                print("in a step", flush=True)
                time.sleep(600)
    with faults.injected(stall):
        step(1)
        engine.synchronize()
""")


def test_a_run_killed_during_a_step_leaves_its_checkpoint_and_the_next_start_cleans_up(tmp_path):
    """SIGKILL while the optimizer thread is inside a step (a disk bucket's slot held, reads and write-backs in
    flight): the checkpoint written before loads and matches the same run in this process bit for bit, and the next
    engine with a disk tier removes the dead run's swap folder."""
    checkpoint = str(tmp_path / "checkpoint.pt")
    script = CHILD.format(tests=str(Path(__file__).parent), offload=str(tmp_path / "offload"), checkpoint=checkpoint)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, cwd=str(Path(__file__).parents[1]))
    try:
        line = child.stdout.readline()
        assert line.strip() == "in a step", (line, child.stderr.read() if child.poll() is not None else "")
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == -signal.SIGKILL
    assert len(_swap_folders(tmp_path)) == 1  # the dead run's files are still there

    saved = torch.load(checkpoint, weights_only=True)
    engine, optimizer = _build(_config(tmp_path, 1e-9), lr=1e-2)
    try:
        assert len(_swap_folders(tmp_path)) == 1 and _swap_folders(tmp_path)[0].split("-")[-2] == str(os.getpid())
        x, mask, y = _batch(0)
        engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy)
        optimizer.step()
        optimizer.zero_grad()
        for name, tensor in engine.state_dict().items():
            assert torch.equal(saved["model"][name], tensor), name
        mine = optimizer.state_dict()["state"]
        for index, entry in saved["optimizer"]["state"].items():
            for key, value in entry.items():
                assert torch.equal(mine[index][key], value), (index, key)
        engine.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])  # and it loads
    finally:
        engine.close()


def _device_names(engine) -> frozenset[str]:
    store = engine.host_store
    return frozenset(slot.name for i in engine.optimizer_placement.device_buckets for slot in store.buckets[i].slots)


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_lagged_steps_lag_the_disks_buckets_as_the_hosts(tmp_path, mix):
    """async_optimizer=True: a disk bucket lags one step as a host bucket does (its stepped weights held apart
    until the next step), a device bucket steps exactly; clipped, accumulated: plain torch's staleness-1 run."""
    config, expected = _mix(tmp_path, mix, async_optimizer=True)
    batches = _batches()
    engine, optimizer = _build(config)
    try:
        placement = engine.optimizer_placement
        assert placement.disk_buckets == (expected or sorted(b.index for b in engine.host_store.trainable_buckets))
        fresh = _device_names(engine)
        assert bool(fresh) == (mix == "device+host+disk")
        ref_norms, ref_weights = plain_training(batches, lagged=True, fresh=fresh)
        norms, _, weights = _train(engine, optimizer, batches)
        _assert_same_run(norms, weights, ref_norms, ref_weights)
    finally:
        engine.close()
    exact = plain_training(batches)[1][-1]
    assert not torch.allclose(ref_weights[-1]["6.linear.weight"], exact["6.linear.weight"], rtol=1e-6)  # it lags


def _looking_run(tmp_path, look: bool):
    config, _ = _mix(tmp_path, "host+disk", async_optimizer=True)
    engine, optimizer = _build(config)
    looked = None
    try:
        losses = []
        for step, passes in enumerate(_batches()):
            losses += _train(engine, optimizer, [passes], look_every_step=False)[1]
            if look and step == 1:
                x, mask, _ = _batch(100)
                with torch.no_grad():
                    first, second = engine(x, mask), engine(x, mask)
                looked = (first, second, copy.deepcopy(engine.state_dict()))
        engine.synchronize()
        return losses, {n: p.detach().clone() for n, p in engine.module.named_parameters()}, looked
    finally:
        engine.close()


def test_looking_during_lagged_steps_on_disk_changes_nothing(tmp_path):
    """An evaluation and a state dict between lagged steps show the newest weights (the disk's held ones too) and
    leave the run bit for bit as one that does not look."""
    losses, final, _ = _looking_run(tmp_path / "a", look=False)
    looked_losses, looked_final, (first, second, state) = _looking_run(tmp_path / "b", look=True)
    assert looked_losses == losses
    for name, tensor in final.items():
        assert torch.equal(looked_final[name], tensor), name
    newest = plain_training(_batches(), lagged=True)[1][1]
    for name, tensor in newest.items():
        torch.testing.assert_close(state[name], tensor, **TOL, msg=name)
    assert torch.equal(first, second)


def _lagged_run(config, batches, checkpoint: dict | None = None) -> tuple[list, dict, dict]:
    """Lagged steps of `batches`, from `checkpoint` when given; the losses, the newest weights and a checkpoint
    (the weights, the optimizer and engine states and the lagged weights the next pass computes with)."""
    engine, optimizer = _build(config)
    try:
        if checkpoint is not None:
            engine.load_state_dict(checkpoint["model"])
            engine.load_engine_state(checkpoint["engine"])
            optimizer.load_state_dict(checkpoint["optimizer"])
            engine.load_lagged_weights(checkpoint["lagged"])
        _, losses, _ = _train(engine, optimizer, batches, look_every_step=False)
        saved = {"model": copy.deepcopy(engine.state_dict()), "optimizer": copy.deepcopy(optimizer.state_dict()),
                 "engine": engine.engine_state(), "lagged": engine.lagged_weights()}
        return losses, {n: p.detach().clone() for n, p in engine.module.named_parameters()}, saved
    finally:
        engine.close()


@pytest.mark.parametrize("before, after", [("host+disk", "host"), ("host", "all disk"), ("all disk", "all disk")])
def test_a_lagged_run_resumes_across_tiers_bitwise(tmp_path, before, after):
    """Two lagged steps, checkpointed with the weights one step old that the next pass computes with, resumed under
    another mix of tiers: the next two steps are the uninterrupted run's, bit for bit."""
    def config(mix):
        return _config(tmp_path, None, async_optimizer=True) if mix == "host" else \
            _mix(tmp_path, mix, async_optimizer=True)[0]

    batches = _batches()
    losses, final, _ = _lagged_run(config("host"), batches)
    first_losses, _, saved = _lagged_run(config(before), batches[:2])
    assert saved["lagged"]  # the held steps travel
    resumed_losses, resumed, _ = _lagged_run(config(after), batches[2:], saved)
    assert first_losses + resumed_losses == losses
    for name, tensor in final.items():
        assert torch.equal(resumed[name], tensor), name


def test_data_parallelism_with_a_disk_tier_is_refused(tmp_path):
    from types import SimpleNamespace

    from accelerate_roundpipe.runtime.state.placement import place_optimizer_state, place_past_host_budget

    engine = RoundPipe(wide_model(), _config(tmp_path, None))
    try:
        optimizer = torch.optim.AdamW(engine.parameters(), lr=LR)
        cpu = SimpleNamespace(device=torch.device("cpu"), is_cuda=False)
        with pytest.raises(OffloadSettingError, match=r"host_memory_budget=1e-09 GiB.*the store needs 0.00\d+ GiB.*"
                                                      r"not supported under data parallelism"):
            placement = place_optimizer_state("auto", None, [cpu], engine.host_store, optimizer, True, None)
            place_past_host_budget(placement, engine.host_store, optimizer, True, 1e-9, str(tmp_path / "offload"),
                                   60.0)
        assert _swap_folders(tmp_path) == []
    finally:
        engine.close()


def test_an_optimizer_whose_state_the_disk_does_not_know_is_refused(tmp_path):
    engine = RoundPipe(wide_model(), _config(tmp_path, 1e-9))
    try:
        with pytest.raises(OffloadSettingError, match=r"Adam, AdamW and SGD only, not of torch.optim.adagrad.Adagrad"):
            engine.wrap_optimizer(torch.optim.Adagrad(engine.parameters(), lr=LR))
    finally:
        engine.close()


@pytest.mark.parametrize("given, expected", [
    ("variable", r"^ROUNDPIPE_HOST_MEMORY_BUDGET='1e-9': the store needs"),
    ("training argument", r"^roundpipe_host_memory_budget='1e-9' \(a RoundPipeTrainingArguments field, "
                          r"--roundpipe_host_memory_budget\): the store needs"),
    ("default", r"^the default host_memory_budget, 0 GiB \(the memory available less 20%, at least 4 GiB; "
                r"host_memory_budget, --roundpipe_host_memory_budget or ROUNDPIPE_HOST_MEMORY_BUDGET sets it\): "
                r"the store needs"),
])
def test_a_disk_refusal_names_the_budget_where_it_was_given(tmp_path, monkeypatch, given, expected):
    """The refusal at wrap_optimizer names host_memory_budget as the user gave it, never a variable nobody set."""
    from accelerate_roundpipe import RoundPipeTrainingArguments
    from accelerate_roundpipe.integrations.training_args import plugin_from_training_args
    from accelerate_roundpipe.runtime.state import placement

    config = _config(tmp_path, None)
    if given == "variable":
        monkeypatch.setenv("ROUNDPIPE_HOST_MEMORY_BUDGET", "1e-9")
        config = _config(tmp_path, None)
    elif given == "training argument":
        config = plugin_from_training_args(RoundPipeTrainingArguments(
            output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none", roundpipe_devices="cpu,cpu",
            roundpipe_summary=False, roundpipe_host_memory_budget="1e-9", roundpipe_offload_dir=str(tmp_path)))
    else:
        monkeypatch.setattr(placement, "available_memory_bytes", lambda: 0)  # a machine with nothing to spare
    engine = RoundPipe(wide_model(), config)
    try:
        with pytest.raises(OffloadSettingError, match=expected) as refused:
            engine.wrap_optimizer(torch.optim.Adagrad(engine.parameters(), lr=LR))
        assert given == "variable" or "ROUNDPIPE_HOST_MEMORY_BUDGET=" not in str(refused.value)
    finally:
        engine.close()


def test_an_offload_dir_that_is_not_a_writable_folder_is_refused(tmp_path):
    not_a_folder = tmp_path / "a-file"
    not_a_folder.write_text("x")
    config = _config(tmp_path, 1e-9)
    config.offload_dir = str(not_a_folder / "below")
    engine = RoundPipe(wide_model(), config)
    try:
        with pytest.raises(OffloadSettingError, match=r"offload_dir=.*a-file is not a folder"):
            engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=LR))
    finally:
        engine.close()


def test_too_little_free_space_is_refused_with_the_numbers(tmp_path, monkeypatch):
    real = folder_checks.shutil.disk_usage
    monkeypatch.setattr(folder_checks.shutil, "disk_usage", lambda path: real(path)._replace(free=2**20))
    engine = RoundPipe(wide_model(), _config(tmp_path, 1e-9))
    try:
        with pytest.raises(OffloadSettingError, match=r"offload_dir=.* has 0.00 GiB free, less than the 1.00 GiB "
                                                      r"required.*raise host_memory_budget"):
            engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=LR))
        assert _swap_folders(tmp_path) == []
    finally:
        engine.close()


@pytest.mark.parametrize("field, value, message", [
    ("host_memory_budget", -1, r"host_memory_budget .*must be a positive, finite size in GiB"),
    ("host_memory_budget", "lots", r"host_memory_budget .*must be a positive, finite size in GiB"),
    ("offload_dir", "  ", r"offload_dir .*must be a folder path"),
])
def test_bad_settings_are_refused_where_given(field, value, message):
    with pytest.raises(SettingError, match=message):
        RoundPipeConfig(**{field: value})


def test_settings_from_the_environment_and_the_default_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("ROUNDPIPE_HOST_MEMORY_BUDGET", "12GiB")
    monkeypatch.setenv("ROUNDPIPE_OFFLOAD_DIR", str(tmp_path))
    config = RoundPipeConfig()
    assert config.host_memory_budget == 12.0 and config.resolved_offload_dir == str(tmp_path)
    monkeypatch.delenv("ROUNDPIPE_OFFLOAD_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", "/cache")
    assert RoundPipeConfig().resolved_offload_dir == "/cache/roundpipe/offload"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert RoundPipeConfig().resolved_offload_dir == os.path.expanduser("~/.cache/roundpipe/offload")


def test_the_summary_and_the_trace_show_the_disk(tmp_path, capsys):
    """The start summary's tiers line (buckets and GiB per tier, the disk's measured bandwidth, the step time it
    implies) and the trace's "disk" track of reads and writes."""
    trace = tmp_path / "trace.json"
    config, expected = _mix(tmp_path, "host+disk", trace_path=str(trace))
    config.summary = True
    engine, optimizer = _build(config)
    try:
        _train(engine, optimizer, _batches(2), look_every_step=False)
        engine.synchronize()
        bandwidth = engine.optimizer_placement.disk.bandwidth
        assert bandwidth.read_gbps > 0 and bandwidth.write_gbps > 0
    finally:
        engine.close()
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if "tiers:" in line]
    assert f"disk {len(expected)} buckets" in line and "host 4 buckets" in line and "device 0 buckets" in line
    assert "GB/s write" in line and "GB/s read" in line and "s a step" in line
    # the host memory line counts the staging slots the disk buckets' steps use (host memory, not the disk's)
    staging = engine.optimizer_placement.staging_bytes
    (host,) = [line for line in err.splitlines() if "host memory:" in line]
    assert staging > 0 and f"{staging / 2**20:.1f} MiB of disk staging slots" in host, host
    assert ("; beside it, outside host_memory_budget: the layer inputs kept for recomputation (they grow with the "
            "rows of a call) and the process's own memory; this process is resident at ") in host, host
    events = json.loads(trace.read_text())["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    disk = [e["name"] for e in events if e.get("ph") == "X" and tracks.get(e.get("tid"), "").startswith("disk io")]
    assert any(name.startswith("read bucket-") for name in disk), disk
    assert any(name.startswith("write bucket-") for name in disk), disk
    # every disk bucket read and written once a step
    assert sum(name.startswith("write ") for name in disk) == 2 * len(expected)


def test_an_exact_step_takes_disk_buckets_in_the_announced_order(tmp_path):
    """With a clip every bucket's gradients are final at once and the step goes bottom-up; the staging refuses an
    acquire out of the announced order, so the step completing at all is the check, and the reads come in that
    order."""
    config, expected = _mix(tmp_path, "all disk")
    engine, optimizer = _build(config)
    order: list[int] = []
    tier = next(b.tier for b in engine.host_store.trainable_buckets)
    acquire = tier.staging.acquire
    tier.staging.acquire = lambda key: (order.append(key), acquire(key))[1]
    try:
        x, mask, y = _batch(3)
        engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy)
        optimizer.clip_grad_norm_(MAX_NORM)
        optimizer.step()
        engine.synchronize()
        bottom_up = [b.index for b in reversed(engine.host_store.trainable_in_backward_order)]
        assert order == bottom_up
        order.clear()
        optimizer.zero_grad()
        engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy)
        optimizer.step()
        engine.synchronize()
        assert order == [b.index for b in engine.host_store.trainable_in_backward_order]
    finally:
        engine.close()
    time.sleep(0)


@pytest.fixture
def swap_file_pieces(monkeypatch) -> list[int]:
    """Every disk bucket of more than one parameter in swap file pieces ([Note: swap files in pieces]); the piece
    counts the layouts got."""
    counts: list[int] = []
    original = disk_tier.piece_splits

    def cut_small(bucket, piece_bytes=None, max_pieces=None):
        splits = original(bucket, piece_bytes=1, max_pieces=max_pieces)
        counts.append(len(splits) + 1)
        return splits

    monkeypatch.setattr(disk_tier, "piece_splits", cut_small)
    return counts


@pytest.mark.parametrize("mix", ["all disk", "device+host+disk"])
def test_exact_steps_with_swap_files_in_pieces_equal_plain_torch(tmp_path, swap_file_pieces, mix):
    test_exact_steps_equal_plain_torch_for_every_mix_of_tiers(tmp_path, mix)
    assert max(swap_file_pieces) > 1  # the files really were in pieces


def test_lagged_steps_with_swap_files_in_pieces_lag_as_the_hosts(tmp_path, swap_file_pieces):
    test_lagged_steps_lag_the_disks_buckets_as_the_hosts(tmp_path, "all disk")
    assert max(swap_file_pieces) > 1


@pytest.mark.parametrize("before, after", [("all disk", "host"), ("host", "all disk")])
def test_resume_with_swap_files_in_pieces_is_bitwise(tmp_path, swap_file_pieces, before, after):
    """The checkpoint maps a pieced file's state parameter by parameter (each inside one piece) and loads back
    into pieces: the same bits as the uninterrupted run."""
    test_resume_across_tiers_is_bitwise(tmp_path, before, after, None)
    assert max(swap_file_pieces) > 1


def test_the_disk_is_measured_before_the_swap_files_are_written(tmp_path, monkeypatch):
    """The probe runs before the first images go to the files: written after them, it measured the kernel's flush of
    tens of GiB still under way (0.38 against 1.35 GB/s on the H100 machine), and the start summary's implied step
    time was 4 times what a step took."""
    from accelerate_roundpipe.runtime.disk import BucketFile

    events = []
    real_probe, real_write = disk_tier.probe_bandwidth, BucketFile.write_range
    monkeypatch.setattr(disk_tier, "probe_bandwidth",
                        lambda *a, **k: (events.append("probe"), real_probe(*a, **k))[1])
    monkeypatch.setattr(BucketFile, "write_range",
                        lambda self, *a: (events.append("write"), real_write(self, *a))[1])
    config, expected = _mix(tmp_path, "all disk")
    engine, _ = _build(config)
    try:
        assert events[0] == "probe" and events.count("probe") == 1, events
        assert events.count("write") >= len(engine.optimizer_placement.disk_buckets) > 0, events
    finally:
        engine.close()


def test_the_implied_step_time_reads_as_seconds_to_three_figures():
    """The tiers line's estimate: three figures (it is a model of the disk, not a measurement), never an exponent."""
    from accelerate_roundpipe.runtime.state.placement import _seconds

    assert [_seconds(s) for s in (130.745, 72.381, 0.00123, 1234.5)] == ["131", "72.4", "0.00123", "1234"]


def test_a_budget_too_small_even_with_everything_on_disk_is_said_in_readable_sizes(tmp_path, caplog):
    """Training goes on over the budget, and the warning says both sizes as the tiers line does: on a small store
    "0.01 GiB ... needs 0.01 GiB" (10.24 against 10.36 MiB on the main job) said nothing."""
    import logging
    import re

    config, _ = _mix(tmp_path, "all disk")
    with caplog.at_level(logging.WARNING):
        engine, _ = _build(config)
    engine.close()
    (message,) = [r.getMessage() for r in caplog.records if "training goes on, over the budget" in r.getMessage()]
    budget, need = re.search(r"host_memory_budget is (\S+ [MG]iB), and the store needs (\S+ [MG]iB)", message).groups()
    assert budget != need and need.endswith("MiB"), message


class _RecordedLocks:
    """Page-locks as a GPU machine's store makes them, recorded (CPU workers lock nothing)."""

    def __init__(self) -> None:
        self.locked: list[int] = []
        self.unlocked: list[int] = []

    def lock(self, buffer: torch.Tensor) -> None:
        self.locked.append(buffer.numel() * buffer.element_size())

    def unlock(self, buffers: list[torch.Tensor]) -> bool:
        self.unlocked += [t.numel() * t.element_size() for t in buffers]
        return True


def test_the_staging_slots_are_page_locked_at_their_exact_size_with_the_stores_buffers(tmp_path):
    """[Note: exact-size pinned memory]: the slots came from torch's page-locked allocator, which rounds a block up to
    a power of two (Llama-3.1-8B's 7.31 GiB of slots took 8 GiB, outside what the start summary counted); they are the
    store's exact-size buffers now, locked with it and unlocked at close()."""
    from accelerate_roundpipe.runtime.devices.pinned import HostMemory

    config, _ = _mix(tmp_path, "host+disk")
    engine = RoundPipe(wide_model(), config)
    locks = _RecordedLocks()
    engine.host_store.memory = HostMemory(pinned=True, locks=locks)  # as on a GPU machine, before any bucket moves
    try:
        optimizer = engine.wrap_optimizer(torch.optim.AdamW([p for p in engine.parameters() if p.requires_grad],
                                                            lr=LR, weight_decay=WEIGHT_DECAY))
        from accelerate_roundpipe.runtime.state.disk_tier import DiskTier

        (tier,) = [t for t in engine.optimizer_placement.tiers if isinstance(t, DiskTier)]
        staging = tier.staging
        slots_bytes = staging.slots * staging.slot_bytes
        assert staging._buffer.numel() == slots_bytes and slots_bytes & (slots_bytes - 1)  # not a power of two here
        assert slots_bytes in locks.locked
        _train(engine, optimizer, _batches(1), look_every_step=False)
    finally:
        engine.close()
    assert slots_bytes in locks.unlocked
