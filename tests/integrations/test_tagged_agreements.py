"""[Note: tagged agreements] with two ranks (two processes, a real gloo group whose timeout is 20 s): a rank at
another point than its peer, in a barrier of its own or at another agreement, makes the agreement raise at once,
naming where each rank was; ranks at the same point agree as before (a failing rank says so), over a file store and,
many times in a row, over a TCP store."""

from __future__ import annotations

import datetime
import multiprocessing
import socket
import time
import traceback

import pytest

GROUP_TIMEOUT_S = 20.0
AT_ONCE_S = 5.0
MANY = 500


def _rank_main(rank: int, init_method: str, case: str, results) -> None:
    import torch.distributed as dist

    from accelerate_roundpipe.integrations.multi_process import RankAgreement

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    agreement = RankAgreement(timeout_s=GROUP_TIMEOUT_S)
    started = time.monotonic()
    try:
        if case == "barrier" and rank == 1:
            dist.barrier()  # the user's `accelerator.wait_for_everyone()`
            outcome = "through the barrier"
        elif case == "another agreement":
            outcome = agreement.all_ok(True, f"at point {'AB'[rank]}", advice="Do it on both.")
        elif case == "one failed":
            outcome = agreement.all_ok(rank == 0, "at point A")
        elif case == "many":
            outcome = sum(agreement.all_ok(True, f"at point {i}") for i in range(MANY))
        else:
            outcome = agreement.all_ok(True, "at point A")
        outcome = [outcome, agreement.all_ok(True, "at point B")] if case == "same" else outcome
        results.put((rank, "ok", outcome, time.monotonic() - started))
    except Exception as error:  # noqa: BLE001 - reported to the test
        results.put((rank, type(error).__name__, str(error) + traceback.format_exc(limit=1),
                     time.monotonic() - started))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two_ranks(tmp_path, case: str, tcp: bool = False) -> dict:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    init_method = f"tcp://127.0.0.1:{_free_port()}" if tcp else \
        f"file://{tmp_path / ('store-' + case.replace(' ', '-'))}"
    processes = [context.Process(target=_rank_main, args=(r, init_method, case, results)) for r in range(2)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(timeout=90)
    alive = [p for p in processes if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, "a rank hung"
    return {rank: (status, detail, elapsed) for rank, status, detail, elapsed in
            (results.get(timeout=5) for _ in range(2))}


@pytest.fixture(autouse=True)
def one_intra_op_thread_per_rank(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def test_a_rank_in_a_barrier_of_its_own_makes_the_agreement_raise_at_once(tmp_path):
    results = _run_two_ranks(tmp_path, "barrier")
    status, detail, elapsed = results[0]
    assert status == "RanksApartError", detail
    assert "at point A on rank 0 of 2 found the ranks apart: rank 1 is in no agreement of RoundPipe's" in detail
    assert "wait_for_everyone" in detail and elapsed < AT_ONCE_S, (elapsed, detail)
    assert results[1][:2] == ("ok", "through the barrier"), results[1]


def test_ranks_at_different_agreements_both_raise_at_once_naming_the_others_point(tmp_path):
    results = _run_two_ranks(tmp_path, "another agreement")
    for rank, other in ((0, "B"), (1, "A")):
        status, detail, elapsed = results[rank]
        assert status == "RanksApartError" and f"rank {1 - rank} is at another: at point {other}" in detail, detail
        assert "Do it on both." in detail and elapsed < AT_ONCE_S, (elapsed, detail)


def test_ranks_at_the_same_point_agree_and_a_failing_rank_says_so(tmp_path):
    assert {rank: r[:2] for rank, r in _run_two_ranks(tmp_path, "same").items()} == \
        {0: ("ok", [True, True]), 1: ("ok", [True, True])}
    assert {rank: r[:2] for rank, r in _run_two_ranks(tmp_path, "one failed").items()} == \
        {0: ("ok", False), 1: ("ok", False)}


def test_many_agreements_in_a_row_over_a_tcp_store_all_agree(tmp_path):
    # TCPStore's `set` does not wait for the server: without reading its entry back, a rank could pass the barrier
    # before its peer's entry was in the store and see that peer "apart" (about one agreement in a hundred).
    results = _run_two_ranks(tmp_path, "many", tcp=True)
    assert {rank: r[:2] for rank, r in results.items()} == {0: ("ok", MANY), 1: ("ok", MANY)}, results


def test_the_default_groups_store_is_reached_through_torchs_private_getter(monkeypatch):
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from process_group_helpers import default_group_up

    from accelerate_roundpipe.compat import LibraryChangedError, torch_internals

    with default_group_up():
        assert isinstance(torch_internals.default_group_store(), dist.Store)
    monkeypatch.setattr(c10d, "_get_default_store", lambda: object())
    with pytest.raises(LibraryChangedError, match="_get_default_store.*not a torch.distributed.Store"):
        torch_internals.default_group_store()
    monkeypatch.delattr(c10d, "_get_default_store")
    with pytest.raises(LibraryChangedError, match="_get_default_store"):
        torch_internals.default_group_store()
