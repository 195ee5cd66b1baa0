"""[Note: memory freed at close]: the optimizer state and the gradients go back when the engine closes (or, dropped
without `close()`, when its finalizer has stopped its threads), without waiting for Python's cycle collector; a new
engine collects earlier engines that are only garbage before it allocates. The collector is off in every test here:
whatever is freed is freed by reference counting alone, as between two collections of a real run."""

from __future__ import annotations

import gc
import logging

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from accelerate_roundpipe import RoundPipe, RoundPipeConfig
from accelerate_roundpipe.runtime.engine import engine_parts

from toy_models import batch, tied_model


@pytest.fixture(autouse=True)
def no_cycle_collector():
    gc.collect()
    gc.disable()
    yield
    gc.enable()
    gc.collect()


def _trained(steps: int = 2):
    engine = RoundPipe(tied_model(), RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=2, summary=False))
    user_optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-3)
    optimizer = engine.wrap_optimizer(user_optimizer)
    x, mask, y = batch(rows=4)
    for _ in range(steps):
        engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy)
        optimizer.step()
    engine.forward_backward(x, mask, labels=y, loss_fn=nn.functional.cross_entropy)  # gradients held at the end
    engine.synchronize()
    return engine, user_optimizer, optimizer


def _storages(engine, optimizer) -> dict[str, list[StorageWeakRef]]:
    """Weak references to the storages (not the tensor objects: the optimizer's parameters view them through
    `.data`) of what the engine holds besides the compute copies."""
    store = engine.host_store
    refs = {"gradients": [StorageWeakRef(b.grad.untyped_storage()) for b in store.trainable_buckets
                          if b.grad is not None],
            "optimizer state": [StorageWeakRef(v.untyped_storage()) for entry in optimizer.state.values()
                                for v in entry.values() if torch.is_tensor(v) and v.numel() > 1],
            "optimizer copies": [StorageWeakRef(b.optim.untyped_storage()) for b in store.trainable_buckets]}
    assert all(refs.values()), {k: len(v) for k, v in refs.items()}
    return refs


def _alive(refs: dict[str, list[StorageWeakRef]]) -> dict[str, int]:
    return {kind: sum(not r.expired() for r in kind_refs) for kind, kind_refs in refs.items()}


def test_close_frees_the_state_while_the_engine_and_optimizer_are_held():
    """As a Trainer holds them after `close()`. Before: every buffer stayed as long as the engine did. The
    parameters of the user's optimizer (the optimizer copies) keep their shapes and dtypes over no memory."""
    engine, user_optimizer, optimizer = _trained()
    refs = _storages(engine, optimizer)
    shapes = [(p.shape, p.dtype) for g in user_optimizer.param_groups for p in g["params"]]
    weights = {k: v.clone() for k, v in engine.module.state_dict().items()}
    engine.close()
    assert _alive(refs) == {"gradients": 0, "optimizer state": 0, "optimizer copies": 0}
    params = [p for g in user_optimizer.param_groups for p in g["params"]]
    assert all(p.grad is None for p in params) and [(p.shape, p.dtype) for p in params] == shapes
    module = engine._modules["module"]  # the user's module still shows the trained weights
    assert all(torch.equal(module.state_dict()[k], v) for k, v in weights.items())


def test_a_closed_engine_dropped_is_freed_without_the_collector():
    """Before: the buckets, the workers and the optimizer refer to one another, and all of it waited for a
    collection of the oldest generation."""
    engine, user_optimizer, optimizer = _trained()
    refs = _storages(engine, optimizer)
    engine.close()
    del engine, user_optimizer, optimizer
    assert _alive(refs) == {"gradients": 0, "optimizer state": 0, "optimizer copies": 0}


def test_an_engine_dropped_without_close_is_freed_without_the_collector():
    engine, user_optimizer, optimizer = _trained()
    refs = _storages(engine, optimizer)
    del engine, user_optimizer, optimizer  # its finalizer stops the threads, then the buffers go
    assert _alive(refs) == {"gradients": 0, "optimizer state": 0, "optimizer copies": 0}


def test_an_engine_freed_inside_a_device_context_still_lets_go_of_its_state():
    """The finalizer runs wherever the last reference goes or the collector runs: here inside
    `with torch.device("meta")`, as a model built on the meta device is (the decoder catalog's mbart case met it
    in CI). Before: the optimizer copies' stand-ins were made on the meta device, `param.data = stand_in` raised
    "incompatible tensor type" inside the finalizer, and the state stayed until the collector."""
    engine, user_optimizer, optimizer = _trained()
    refs = _storages(engine, optimizer)
    params = [p for g in user_optimizer.param_groups for p in g["params"]]
    with torch.device("meta"):
        del engine, user_optimizer, optimizer  # its finalizer stops the threads and lets go, in this context
    assert _alive(refs) == {"gradients": 0, "optimizer state": 0, "optimizer copies": 0}
    assert all(p.device.type == "cpu" for p in params)


def test_a_new_engine_collects_earlier_ones_left_in_cycles(monkeypatch):
    """A notebook's previous Trainer, dropped, still refers to itself (as a Trainer does): only a collection frees
    its engine, and the new engine runs one first."""
    monkeypatch.setattr(engine_parts, "COLLECT_ABOVE_BYTES", 0)
    engine, user_optimizer, optimizer = _trained()
    refs = _storages(engine, optimizer)
    holder = {"engine": engine, "optimizer": optimizer}
    holder["self"] = holder  # a cycle, as a Trainer and its callbacks make
    del engine, user_optimizer, optimizer, holder
    assert _alive(refs)["optimizer state"] > 0  # garbage, not freed yet
    RoundPipe(tied_model(), RoundPipeConfig(devices=["cpu"], summary=False))
    assert _alive(refs) == {"gradients": 0, "optimizer state": 0, "optimizer copies": 0}


def test_a_new_engine_warns_of_earlier_ones_still_open(monkeypatch, caplog):
    monkeypatch.setattr(engine_parts, "COLLECT_ABOVE_BYTES", 0)
    earlier, _, _ = _trained()
    with caplog.at_level(logging.WARNING, logger=engine_parts.__name__):
        later = RoundPipe(tied_model(), RoundPipeConfig(devices=["cpu"], summary=False))
    assert "1 earlier RoundPipe engine(s) in this process are still open" in caplog.text
    assert "engine.close()" in caplog.text
    caplog.clear()
    earlier.close()
    later.close()
    with caplog.at_level(logging.WARNING, logger=engine_parts.__name__):
        RoundPipe(tied_model(), RoundPipeConfig(devices=["cpu"], summary=False)).close()
    assert "still open" not in caplog.text  # closed engines hold nothing worth a warning


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("placement", ["device", "host"])
def test_close_gives_the_device_memory_back(placement):
    """On a GPU, with the engine still held: after `close()` the device holds nothing of it (the optimizer state
    placed there, the gradients, the idle weight buffers), with the collector off."""
    width = 512
    torch.manual_seed(0)
    layers = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(6)])
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()  # cuBLAS's per-stream workspaces are not the engine's
    before = torch.cuda.memory_allocated()
    engine = RoundPipe(layers, RoundPipeConfig(devices=["cuda:0"], num_microbatches=2, summary=False,
                                               optimizer_placement=placement))
    optimizer = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-3))
    x, y = torch.randn(8, width), torch.randn(8, width)
    for _ in range(2):
        engine.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)
        optimizer.step()
    engine.synchronize()
    trained = torch.cuda.memory_allocated() - before
    assert trained > 0
    engine.close()
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    held = torch.cuda.memory_allocated() - before
    assert held <= 2**20, f"{held / 2**20:.2f} MiB of {trained / 2**20:.2f} MiB still on the device after close()"
    del optimizer, engine
