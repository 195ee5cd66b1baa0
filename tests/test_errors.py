"""Bad input gets a clear error; a failure in any thread reaches the caller within seconds; nothing hangs."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from accelerate_roundpipe import EngineClosedError, RoundPipe, RoundPipeConfig
from accelerate_roundpipe.runtime.common import faults
from accelerate_roundpipe.runtime.execution.layer_copy import StatefulLayerError


def small(*extra: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), *extra, nn.Linear(4, 3))


def fb(engine, rows=4):
    return engine.forward_backward(torch.randn(rows, 4), labels=torch.randint(0, 3, (rows,)),
                                   loss_fn=nn.functional.cross_entropy)


class Boom(nn.Module):
    def forward(self, x):
        raise ValueError("boom in layer")


class ReturnsDict(nn.Module):
    def forward(self, x):
        return {"h": x}


def test_not_a_sequential():
    with pytest.raises(TypeError, match="nn.Sequential"):
        RoundPipe(nn.Linear(3, 3), RoundPipeConfig(devices=["cpu"]))


def test_batch_smaller_than_microbatch_count_names_the_knob(monkeypatch):
    engine = RoundPipe(small(), RoundPipeConfig(devices=["cpu"], num_microbatches=4))
    with pytest.raises(ValueError, match=r"3 rows but num_microbatches is 4 \(given as num_microbatches "
                                         r"\(--roundpipe_num_microbatches, env ROUNDPIPE_NUM_MICROBATCHES\)=4\)"):
        fb(engine, rows=3)
    engine.close()
    # Named where it was given: the variable, or a training argument (the message named the variable for both).
    monkeypatch.setenv("ROUNDPIPE_NUM_MICROBATCHES", "4")
    engine = RoundPipe(small(), RoundPipeConfig(devices=["cpu"]))
    with pytest.raises(ValueError, match=r"3 rows but num_microbatches is 4 \(given as ROUNDPIPE_NUM_MICROBATCHES="):
        fb(engine, rows=3)
    engine.close()
    monkeypatch.delenv("ROUNDPIPE_NUM_MICROBATCHES")
    from accelerate_roundpipe import RoundPipeTrainingArguments
    from accelerate_roundpipe.integrations.training_args import plugin_from_training_args

    args = RoundPipeTrainingArguments(output_dir="unused", use_cpu=True, report_to=[], roundpipe_devices="cpu",
                                      roundpipe_num_microbatches=4)
    engine = RoundPipe(small(), plugin_from_training_args(args))
    with pytest.raises(ValueError, match=r"3 rows but num_microbatches is 4 \(given as roundpipe_num_microbatches=4 "
                                         r"\(a RoundPipeTrainingArguments field"):
        fb(engine, rows=3)
    engine.close()


def test_default_microbatch_count_adapts_to_small_batches():
    x, y = torch.randn(2, 4), torch.randint(0, 3, (2,))
    # The reference first: the loss returns before the backward ends, and a CPU worker's recompute forks the
    # process-wide RNG, which a `small()` built meanwhile would race with.
    expected = nn.functional.cross_entropy(small()(x), y)
    engine = RoundPipe(small(), RoundPipeConfig(devices=["cpu"] * 3))  # default: 6 micro-batches
    loss = engine.forward_backward(x, labels=y, loss_fn=nn.functional.cross_entropy)
    assert torch.allclose(loss, expected)
    engine.close()


def test_mismatched_batch_sizes_and_non_tensor_inputs():
    engine = RoundPipe(small(), RoundPipeConfig(devices=["cpu"]))
    with pytest.raises(ValueError, match="same size"):
        engine.forward_backward(torch.randn(4, 4), torch.randn(3, 4), labels=torch.zeros(4, dtype=torch.long),
                                loss_fn=nn.functional.cross_entropy)
    with pytest.raises(TypeError, match="must be tensors"):
        engine.forward_backward([1, 2], labels=None)
    engine.close()


def test_layer_output_that_is_not_tensors():
    engine = RoundPipe(small(ReturnsDict()), RoundPipeConfig(devices=["cpu", "cpu"]))
    with pytest.raises(TypeError, match=r"layer 2 \(ReturnsDict\) returned dict"):
        fb(engine)
    engine.close()


@pytest.mark.parametrize("num_devices", [1, 3])
def test_worker_exception_surfaces_then_engine_is_closed(num_devices):
    engine = RoundPipe(small(Boom()), RoundPipeConfig(devices=["cpu"] * num_devices, num_microbatches=2))
    start = time.monotonic()
    with pytest.raises(ValueError, match="boom in layer") as info:
        fb(engine)
    assert time.monotonic() - start < 5
    assert any("raised in worker" in note for note in getattr(info.value, "__notes__", []))
    with pytest.raises(EngineClosedError, match="boom in layer"):
        fb(engine)
    with pytest.raises(EngineClosedError):
        engine.synchronize()


def test_optimizer_thread_exception_surfaces():
    class Broken(torch.optim.SGD):
        def step(self, closure=None):
            raise RuntimeError("optimizer exploded")

    engine = RoundPipe(small(), RoundPipeConfig(devices=["cpu", "cpu"]))
    optimizer = engine.wrap_optimizer(Broken(engine.parameters(), lr=0.1))
    fb(engine)
    optimizer.step()
    with pytest.raises(RuntimeError, match="optimizer exploded"):
        engine.synchronize()
    with pytest.raises(EngineClosedError):
        fb(engine)


def test_injected_fault_in_a_transfer_surfaces():
    engine = RoundPipe(small(), RoundPipeConfig(devices=["cpu", "cpu"]))

    def hook(point):
        if point == "transfer.download":
            raise OSError("link down")

    with faults.injected(hook), pytest.raises(OSError, match="link down"):
        fb(engine)


def test_stalled_worker_raises_timeout_instead_of_hanging():
    engine = RoundPipe(small(), RoundPipeConfig(devices=["cpu", "cpu"], wait_timeout_s=0.5))

    def hook(point):
        if point == "worker.task":
            time.sleep(1.5)

    start = time.monotonic()
    with faults.injected(hook), pytest.raises(TimeoutError, match="wait_timeout_s"):
        fb(engine)
    assert time.monotonic() - start < 5
    with pytest.raises(EngineClosedError, match="timed out"):
        fb(engine)
    engine.close()


def test_stateful_layer_is_rejected():
    engine = RoundPipe(small(nn.BatchNorm1d(4)), RoundPipeConfig(devices=["cpu"]))
    with pytest.raises(StatefulLayerError, match=r"layer 2 \(BatchNorm1d\) changed its state in forward"):
        fb(engine)


def test_unwrapped_optimizer_is_detected():
    """Its step is refused ([Note: optimizers the engine does not step]); a change of the optimizer copies made
    without any optimizer is found at the next pass."""
    engine = RoundPipe(small(), RoundPipeConfig(devices=["cpu"]))
    optimizer = torch.optim.SGD(engine.parameters(), lr=0.1)
    fb(engine)
    engine.synchronize()
    with pytest.raises(RuntimeError, match="wrap_optimizer"):
        optimizer.step()
    with torch.no_grad():
        next(engine.parameters()).add_(1.0)
    with pytest.raises(RuntimeError, match="wrap_optimizer"):
        fb(engine)
    engine.close()


def test_optimizer_over_foreign_parameters_is_rejected():
    module = small()
    engine = RoundPipe(module, RoundPipeConfig(devices=["cpu"]))
    with pytest.raises(ValueError, match="engine.parameters"):
        engine.wrap_optimizer(torch.optim.SGD(module.parameters(), lr=0.1))
    engine.close()


def test_moving_the_engine_is_refused():
    engine = RoundPipe(small(), RoundPipeConfig(devices=["cpu"]))
    assert engine.to("cpu") is engine
    with pytest.raises(RuntimeError, match="devices="):
        engine.to(torch.float16)
    with pytest.raises(RuntimeError, match="param_dtype"):
        engine.half()
    engine.close()


def test_step_between_forward_and_backward_is_refused():
    engine = RoundPipe(small(), RoundPipeConfig(devices=["cpu"], async_optimizer=False))
    optimizer = engine.wrap_optimizer(torch.optim.SGD(engine.parameters(), lr=0.1))
    fb(engine)
    out = engine(torch.randn(4, 4))
    optimizer.step()
    with pytest.raises(RuntimeError, match="weights changed between model"):
        out.sum().backward()
    engine.close()


@pytest.mark.parametrize("async_optimizer", [False, True])
def test_a_look_between_forward_and_backward_changes_nothing(async_optimizer):
    """`synchronize()` (what `accelerator.unwrap_model` does; TRL's DPO calls it between the policy's forward and
    its backward) writes the newest weights where the host reads them but changes no version a pass reads: the
    backward runs, with the gradients of a run that did not look."""
    grads = []
    for look in (False, True):
        torch.manual_seed(0)
        engine = RoundPipe(small().double(), RoundPipeConfig(devices=["cpu"], async_optimizer=async_optimizer))
        optimizer = engine.wrap_optimizer(torch.optim.SGD(engine.parameters(), lr=0.1))
        x = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        for _ in range(2):  # a step taken: an exact step's version sits in the optimizer copy, a lagged one is held
            engine(x).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        out = engine(x)
        if look:
            engine.synchronize()
        out.square().sum().backward()
        engine.synchronize()
        grads.append([p.grad.clone() for p in engine.parameters()])
        engine.close()
    for plain, looked in zip(*grads):
        torch.testing.assert_close(looked, plain, rtol=0, atol=0)


def test_closed_engine_says_so():
    engine = RoundPipe(small(), RoundPipeConfig(devices=["cpu"]))
    fb(engine)
    engine.close()
    with pytest.raises(EngineClosedError, match="closed"):
        fb(engine)


def test_gpu_out_of_memory_names_the_knobs():
    engine = RoundPipe(small(), RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=2))

    def hook(point):
        if point == "worker.task":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    with faults.injected(hook), pytest.raises(torch.cuda.OutOfMemoryError, match="ROUNDPIPE_NUM_MICROBATCHES") as info:
        fb(engine)
    assert "recompute='layer'" in str(info.value) and "Tried to allocate" in str(info.value)


def test_short_batches_can_be_allowed_with_one_warning(caplog):
    """[Note: short batches]: the last batch of each epoch may be short (one warning per engine); two short
    batches in a row mean every batch is, and the second is an error naming the setting."""
    import logging

    engine = RoundPipe(small(), RoundPipeConfig(devices=["cpu"], num_microbatches=4), allow_short_batches=True)
    x, y = torch.randn(4, 4), torch.randint(0, 3, (4,))
    reference = nn.functional.cross_entropy(small()(x[:3]), y[:3])
    loss_fn = nn.functional.cross_entropy
    with caplog.at_level(logging.WARNING):
        loss = engine.forward_backward(x[:3], labels=y[:3], loss_fn=loss_fn)  # end of epoch 1
        engine.forward_backward(x, labels=y, loss_fn=loss_fn)  # a full batch of epoch 2
        engine.forward_backward(x[:2], labels=y[:2], loss_fn=loss_fn)  # end of epoch 2
    assert torch.allclose(loss, reference) and caplog.text.count("Shown once") == 1
    assert engine.config.num_microbatches == 4
    with pytest.raises(ValueError, match=r"2 rows but num_microbatches is 4 \(given as .*\) "
                                         r"\(the second short batch in a row.*Set num_microbatches to at most 2"):
        engine.forward_backward(x[:2], labels=y[:2], loss_fn=loss_fn)
    engine.close()


def test_every_task_kind_has_an_interpreter_and_a_missing_one_is_named():
    from accelerate_roundpipe.plan.schedule import TaskKind

    engine = RoundPipe(small(), RoundPipeConfig(devices=["cpu"], num_microbatches=2))
    fb(engine)
    worker = engine._dispatch.workers[0]
    assert set(worker._interpreters) == set(TaskKind)
    del worker._interpreters[TaskKind.FUSED]
    with pytest.raises(ValueError, match="no worker runs"):
        fb(engine)


@pytest.mark.parametrize("devices", [["cuda:0"], ["cpu", "cuda"]])
def test_cuda_devices_without_cuda_name_the_setting(devices):
    """Before: a bare `AssertionError: Torch not compiled with CUDA enabled` from the first pinned buffer."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match=r"devices \(env ROUNDPIPE_DEVICES\)=.* names CUDA devices, but .*"
                                         r"ROUNDPIPE_DEVICES=cpu,cpu, --roundpipe_devices cpu,cpu"):
        RoundPipe(small(), RoundPipeConfig(devices=devices))


def test_cuda_device_index_beyond_the_visible_gpus(monkeypatch):
    from accelerate_roundpipe.config import check_cuda_devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_cuda_devices([torch.device("cuda", 0), torch.device("cuda", 1)])
    with pytest.raises(ValueError, match=r"names cuda:2, but only 2 CUDA GPU\(s\) are visible \(cuda:0 to cuda:1\)"):
        check_cuda_devices([torch.device("cuda", 0), torch.device("cuda", 2)])


def test_pinned_memory_without_cuda_names_the_setting():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match=r"pin_memory \(env ROUNDPIPE_PIN_MEMORY\) is true.*ROUNDPIPE_PIN_MEMORY=0"):
        RoundPipe(small(), RoundPipeConfig(devices=["cpu"], pin_memory=True))
