"""[Note: staged checkpoints] with two ranks (two processes, a real gloo group): every rank's files end up in the
renamed checkpoint, and a rank failing mid-save makes both ranks fail, discards the directory and hangs nobody."""

from __future__ import annotations

import multiprocessing
import os
import traceback

import pytest


def _rank_main(rank: int, store: str, run_dir: str, fail_rank: int | None, results) -> None:
    import torch.distributed as dist

    from accelerate_roundpipe.integrations.multi_process import RankAgreement
    from accelerate_roundpipe.integrations.staged_checkpoint import staged

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        final = os.path.join(run_dir, "checkpoint-5")
        with staged(final, RankAgreement(), is_writer=rank == 0) as staging:
            folder = os.path.join(staging, "checkpoint-5")
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, f"shard{rank}"), "w") as f:
                f.write(str(rank))
            if rank == fail_rank:
                raise OSError("disk full (injected)")
        # After the block every rank sees the renamed checkpoint (the third agreement).
        results.put((rank, "ok", sorted(os.listdir(final))))
    except Exception as error:  # noqa: BLE001 - reported to the test
        results.put((rank, type(error).__name__, str(error) + traceback.format_exc(limit=1)))
    finally:
        dist.destroy_process_group()


def _run_two_ranks(tmp_path, fail_rank):
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    store = str(tmp_path / f"store{fail_rank}")
    processes = [context.Process(target=_rank_main, args=(r, store, str(run_dir), fail_rank, results))
                 for r in range(2)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(timeout=60)
    alive = [p for p in processes if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, "a rank hung"
    return dict((rank, (status, detail)) for rank, status, detail in (results.get(timeout=5) for _ in range(2))), \
        run_dir


@pytest.fixture(autouse=True)
def one_intra_op_thread_per_rank(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def test_every_rank_writes_before_the_rename(tmp_path):
    results, run_dir = _run_two_ranks(tmp_path, fail_rank=None)
    assert results == {0: ("ok", ["shard0", "shard1"]), 1: ("ok", ["shard0", "shard1"])}
    assert sorted(os.listdir(run_dir)) == ["checkpoint-5"]  # no staging directory left


@pytest.mark.parametrize("fail_rank", [0, 1])
def test_a_failing_rank_fails_every_rank_and_leaves_no_checkpoint(tmp_path, fail_rank):
    results, run_dir = _run_two_ranks(tmp_path, fail_rank=fail_rank)
    assert results[fail_rank][0] == "OSError"
    other = 1 - fail_rank
    assert results[other][0] == "RuntimeError" and "another rank failed while writing" in results[other][1]
    assert os.listdir(run_dir) == []  # neither checkpoint-5 nor tmp-checkpoint-5
