"""Reported waits are measured ones: `close()` while a thread still runs a slow layer, and a wait that timed out."""

from __future__ import annotations

import logging
import re
import threading
import time

import pytest
import torch
from torch import nn

from accelerate_roundpipe import RoundPipe, RoundPipeConfig
from accelerate_roundpipe.runtime.common import faults
from accelerate_roundpipe.runtime.common.sync import FailureFlag
from accelerate_roundpipe.runtime.engine import engine_threads

TASKS_PER_PASS = 4  # two forward-side tasks, the fused stage, one backward stage: the last one ends after the loss
SLOW_S = 2.5


def test_close_reports_the_seconds_it_really_waited(monkeypatch, caplog):
    """Before: each warning added the nominal interval, while the joins of threads that had already ended returned
    at once: "waited 10 s" after about 1.7 s, "30 s" before returning at 24 s."""
    monkeypatch.setattr(engine_threads, "CLOSE_WARNING_S", 1.0)
    slow_started = threading.Event()
    tasks = 0

    def slow_last_task_of_the_second_pass(point: str) -> None:
        nonlocal tasks
        if point == "worker.task":
            tasks += 1
            if tasks == 2 * TASKS_PER_PASS:
                slow_started.set()
                time.sleep(SLOW_S)  # a slow layer, still running when close() is called

    torch.manual_seed(0)
    engine = RoundPipe(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3)),
                       RoundPipeConfig(devices=["cpu", "cpu"], num_microbatches=2))
    with faults.injected(slow_last_task_of_the_second_pass):
        for _ in range(2):
            engine.forward_backward(torch.randn(4, 4), labels=torch.randint(0, 3, (4,)),
                                    loss_fn=nn.functional.cross_entropy)
        assert slow_started.wait(30)
        engine._failure.fail(RuntimeError("a failure elsewhere"), "the test")  # close() skips the synchronize
        with pytest.raises(RuntimeError, match="a failure elsewhere"):
            engine.synchronize()
        start = time.time()
        with caplog.at_level(logging.WARNING, logger=engine_threads.__name__):
            engine.close()
        closed_after = time.time() - start
    reports = [(float(re.search(r"has waited ([\d.]+) s", r.getMessage()).group(1)), r.created - start)
               for r in caplog.records if "close() has waited" in r.getMessage()]
    assert reports, caplog.text
    for reported, measured in reports:
        assert abs(reported - measured) < 0.3, (reports, closed_after)
    assert max(reported for reported, _ in reports) <= closed_after


def test_a_timed_out_wait_reports_the_seconds_it_really_waited():
    """Before: the message gave the configured timeout ("waited 0.1 s"), however long the wait had really taken
    (here each poll sleeps 0.6 s, as a wait does on a busy machine)."""
    flag = FailureFlag(timeout_s=0.1)
    cond = threading.Condition()
    start = time.monotonic()
    with cond, pytest.raises(TimeoutError, match=r"wait_timeout_s=0.1.*ROUNDPIPE_WAIT_TIMEOUT_S") as timed_out:
        flag.wait(cond, lambda: False, "a result that never comes", poll_s=0.6)
    measured = time.monotonic() - start
    reported = float(re.search(r"waited ([\d.]+) s", str(timed_out.value)).group(1))
    assert abs(reported - measured) < 0.2, (reported, measured)
