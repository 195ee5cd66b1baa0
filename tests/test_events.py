"""The per-bucket ticket protocol (sync.py) keeps program order under injected delays."""

from __future__ import annotations

import random
import threading
import time

import pytest

from accelerate_roundpipe.runtime.common.sync import (
    EngineClosedError,
    FailureFlag,
    Future,
    ReadWriteOrder,
    Sequencer,
    wait_for_any_turn,
)


def run_threads(jobs):
    threads = [threading.Thread(target=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
        assert not t.is_alive(), "a thread hung"


def test_reads_see_exactly_the_version_reserved_and_writes_wait_for_readers():
    failure = FailureFlag(timeout_s=10)
    order = ReadWriteOrder()
    rng = random.Random(0)
    value = {"v": 0, "writing": False}
    log = []
    plan = []  # program order: reservations made here, on one thread
    for step in range(30):
        kind = "w" if step % 4 == 3 else "r"
        plan.append((kind, order.reserve_write() if kind == "w" else order.reserve_read()))
    delays = [rng.random() * 0.003 for _ in plan]

    def make(kind, ticket, delay):
        def job():
            time.sleep(delay)
            if kind == "r":
                order.begin_read(ticket, failure, "read")
                assert not value["writing"]
                log.append(("r", ticket, value["v"]))
                time.sleep(delay / 2)
                order.end_read(ticket)
            else:
                order.begin_write(ticket, failure, "write")
                value["writing"] = True
                time.sleep(delay / 2)
                value["v"] += 1
                value["writing"] = False
                log.append(("w", ticket, value["v"]))
                order.end_write(ticket)
        return job

    run_threads([make(k, t, d) for (k, t), d in zip(plan, delays)])
    for kind, ticket, seen in log:
        if kind == "r":
            assert seen == ticket  # a read reserved after `ticket` writes sees exactly that version
    writes = [entry for entry in log if entry[0] == "w"]
    assert [w[1] for w in writes] == sorted(w[1] for w in writes)
    # Every write happened after every read reserved before it.
    position = {(k, t, i): n for n, (k, t, i) in enumerate(log)}
    for (k, t, _), n in position.items():
        if k == "w":
            assert all(m < n for (k2, t2, _), m in position.items() if k2 == "r" and t2 <= t)


def test_sequencer_runs_in_reservation_order_whatever_the_timing():
    failure = FailureFlag(timeout_s=10)
    seq = Sequencer()
    tickets = [seq.reserve() for _ in range(25)]
    rng = random.Random(1)
    log = []

    def make(ticket):
        delay = rng.random() * 0.003

        def job():
            time.sleep(delay)
            seq.begin(ticket, failure, "turn")
            log.append(ticket)
            seq.end(ticket)
        return job

    jobs = [make(t) for t in tickets]
    random.Random(2).shuffle(jobs)
    run_threads(jobs)
    assert log == tickets and seq.idle


def test_a_failure_wakes_every_waiter_and_reaches_the_caller_once():
    failure = FailureFlag(timeout_s=30)
    future = Future("a value")
    errors = []

    def waiter():
        try:
            future.get(failure)
        except BaseException as error:  # noqa: BLE001
            errors.append(error)

    threads = [threading.Thread(target=waiter) for _ in range(3)]
    for t in threads:
        t.start()
    start = time.monotonic()
    failure.fail(ValueError("boom"), "a test thread")
    for t in threads:
        t.join(5)
    assert time.monotonic() - start < 2
    assert len(errors) == 3
    assert sum(isinstance(e, ValueError) for e in errors) == 1  # the original error once...
    assert sum(isinstance(e, EngineClosedError) for e in errors) == 2  # ...then "closed"


def test_a_wait_times_out_instead_of_hanging():
    failure = FailureFlag(timeout_s=0.3)
    with pytest.raises(TimeoutError, match="ROUNDPIPE_WAIT_TIMEOUT_S"):
        Future("never").get(failure)


@pytest.mark.parametrize("delay_s", [0.0, 0.002, 0.02])
def test_a_wait_over_several_sequencers_is_woken_by_whichever_turn_comes(delay_s):
    # The zero_grad job waits so over every bucket's sequencer: the one whose turn comes may be any of them, not
    # the first. A wait woken only by the first would see the third's turn only at its timeout (a TimeoutError here,
    # since the first never turns); one re-checked only on wake-ups must also see turns that ended before it began.
    failure = FailureFlag(timeout_s=5)
    sequencers = [Sequencer() for _ in range(3)]
    tickets = [[s.reserve(), s.reserve()] for s in sequencers]
    sequencers[1].begin(tickets[1][0], failure, "turn")
    sequencers[1].end(tickets[1][0])  # ended before the wait: found by its first check
    turns = [(sequencers[0], tickets[0][1]), (sequencers[2], tickets[2][1])]
    found = []

    def waiter():
        found.append(wait_for_any_turn(turns, failure, "any turn"))

    def ender():
        time.sleep(delay_s)
        sequencers[2].begin(tickets[2][0], failure, "turn")
        sequencers[2].end(tickets[2][0])

    run_threads([waiter, ender])
    assert found == [[1]]
    assert all(not s._watchers for s in sequencers)  # the watch is gone with the wait
    assert wait_for_any_turn([(sequencers[1], tickets[1][1])], failure, "already") == [0]
