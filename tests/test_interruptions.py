"""The smaller ways the engine API went wrong: an interrupted reservation, `close()` during a slow layer, an empty
batch, inputs of another dtype than the model's."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
from torch import nn

from accelerate_roundpipe import RoundPipe, RoundPipeConfig
from accelerate_roundpipe.runtime.common import faults
from accelerate_roundpipe.runtime.common.sync import InterruptedReservationError
from accelerate_roundpipe.runtime.engine import engine_threads


def _small() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3))


def _train(engine: RoundPipe, rows: int = 4) -> torch.Tensor:
    return engine.forward_backward(torch.randn(rows, 4), labels=torch.randint(0, 3, (rows,)),
                                   loss_fn=nn.functional.cross_entropy)


def test_an_interrupted_reservation_closes_the_engine_instead_of_hanging():
    """Before: a KeyboardInterrupt between a task's reservation and its submission left a read ticket nobody
    would end; the next step's write-back waited for it until wait_timeout_s and then blamed slowness."""
    engine = RoundPipe(_small(), RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=2, wait_timeout_s=3))
    optimizer = engine.wrap_optimizer(torch.optim.SGD(engine.parameters(), lr=0.1))
    _train(engine)

    def interrupt(point: str) -> None:
        if point == "dispatch.enqueue":
            raise KeyboardInterrupt

    with faults.injected(interrupt), pytest.raises(KeyboardInterrupt):
        _train(engine)
    start = time.monotonic()
    with pytest.raises(InterruptedReservationError, match="KeyboardInterrupt interrupted pass 1"):
        optimizer.step()
        engine.synchronize()
    assert time.monotonic() - start < 1.0
    engine.close()


SLOW_STARTED, SLOW_ENDED = threading.Event(), threading.Event()


class _SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        SLOW_STARTED.set()
        time.sleep(1.5)
        SLOW_ENDED.set()
        return grad


class SlowInBackward(nn.Module):
    def forward(self, x):
        return _SlowBackward.apply(x)


def test_close_waits_for_a_thread_in_a_slow_layer(monkeypatch, caplog):
    """Before: close() gave up on a thread after 10 s and freed the host memory under it."""
    monkeypatch.setattr(engine_threads, "CLOSE_WARNING_S", 0.3)
    SLOW_STARTED.clear()
    SLOW_ENDED.clear()
    torch.manual_seed(0)
    engine = RoundPipe(nn.Sequential(nn.Linear(4, 4), SlowInBackward(), nn.Linear(4, 3)),
                       RoundPipeConfig(devices=["cpu"], num_microbatches=1))
    _train(engine)  # the loss comes back before the backward, which then sleeps in SlowInBackward
    assert SLOW_STARTED.wait(10)
    engine._failure.fail(RuntimeError("a failure elsewhere"), "the test")  # as if another thread had failed
    with pytest.raises(RuntimeError, match="a failure elsewhere"):
        engine.synchronize()
    assert not SLOW_ENDED.is_set()  # the worker is still in the slow backward
    threads = [t for w in engine._dispatch.workers for t in w.threads]
    with caplog.at_level(logging.WARNING):
        engine.close()
    assert SLOW_ENDED.is_set() and not any(t.is_alive() for t in threads)
    assert "close() has waited" in caplog.text


def test_an_empty_batch_says_so():
    """Before: "Set num_microbatches to at most 0"."""
    engine = RoundPipe(_small(), RoundPipeConfig(devices=["cpu"], num_microbatches=2))
    with pytest.raises(ValueError, match=r"the batch is empty \(inputs of shapes \[\(0, 4\)\]\)"):
        _train(engine, rows=0)
    engine.close()


@pytest.mark.parametrize("train", [True, False])
def test_inputs_of_another_dtype_than_the_model_say_what_to_cast(train):
    """Before: torch's bare "mat1 and mat2 must have the same dtype"."""
    engine = RoundPipe(_small(), RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=2,
                                                 param_dtype=torch.float16))
    with pytest.raises(RuntimeError, match="same dtype") as info:
        if train:
            _train(engine)
        else:
            with torch.no_grad():
                engine(torch.randn(4, 4))
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "the layers compute in float16" in notes and "the inputs are float32" in notes
    assert "x.to(torch.float16)" in notes


def test_cpu_workers_leave_the_process_wide_generator_alone():
    """Before: CPU workers seeded and restored the process-wide generator around each layer, so a seeded draw on
    another thread meanwhile could come out of a worker's stream (seen in 1 of 199 batches)."""
    torch.manual_seed(0)
    width = 256
    layers = [m for _ in range(4) for m in (nn.Linear(width, width), nn.Dropout(0.5))]
    engine = RoundPipe(nn.Sequential(*layers, nn.Linear(width, 3)),
                       RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=4))
    x, y = torch.randn(64, width), torch.randint(0, 3, (64,))
    torch.manual_seed(123)
    expected = torch.rand(64)
    done = threading.Event()
    errors: list[BaseException] = []

    def train() -> None:
        try:
            for _ in range(15):
                engine.forward_backward(x, labels=y, loss_fn=nn.functional.cross_entropy)
            engine.synchronize()
        except BaseException as error:  # noqa: BLE001 - re-raised below
            errors.append(error)
        finally:
            done.set()

    trainer = threading.Thread(target=train)
    trainer.start()
    draws = mismatches = 0
    while not done.is_set():
        torch.manual_seed(123)
        mismatches += not torch.equal(torch.rand(64), expected)
        draws += 1
    trainer.join()
    engine.close()
    assert not errors, errors
    assert draws > 0 and mismatches == 0, f"{mismatches} of {draws} seeded draws came out of a worker's stream"
