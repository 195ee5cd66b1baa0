"""Which optimizer files a resume of another world size reads ([Note: shards of another world size])."""

from __future__ import annotations

import pytest

from accelerate_roundpipe.integrations.multi_process import written_by_another_world_size


def touch(directory, *names: str) -> str:
    for name in names:
        (directory / name).write_text("")
    return str(directory)


def test_this_runs_own_file_or_none_at_all_is_not_another_world_size(tmp_path):
    assert written_by_another_world_size(touch(tmp_path, "optimizer.pt"), "optimizer.pt", 0, 1) is None
    assert written_by_another_world_size(str(tmp_path / "missing"), "optimizer.pt", 0, 1) is None
    empty = tmp_path / "empty"
    empty.mkdir()
    assert written_by_another_world_size(str(empty), "optimizer.pt", 1, 2) is None


def test_every_ranks_shard_or_the_one_process_file(tmp_path):
    directory = touch(tmp_path, "optimizer.rank1-of-3.pt", "optimizer.rank0-of-3.pt", "optimizer.rank2-of-3.pt",
                      "optimizer_1.rank0-of-2.pt")
    paths, written = written_by_another_world_size(directory, "optimizer.pt", 0, 1)
    assert written == 3 and [p.rsplit("/", 1)[1] for p in paths] == [f"optimizer.rank{r}-of-3.pt" for r in range(3)]
    one = tmp_path / "one"
    one.mkdir()
    paths, written = written_by_another_world_size(touch(one, "optimizer.bin"), "optimizer.bin", 1, 2)
    assert written == 1 and paths == [str(one / "optimizer.bin")]


def test_a_missing_rank_or_two_runs_are_refused(tmp_path):
    directory = touch(tmp_path, "optimizer.rank0-of-3.pt", "optimizer.rank2-of-3.pt")
    with pytest.raises(FileNotFoundError, match=r"3 processes, but not those of rank\(s\) \[1\]"):
        written_by_another_world_size(directory, "optimizer.pt", 0, 1)
    touch(tmp_path, "optimizer.rank1-of-3.pt", "optimizer.rank0-of-2.pt", "optimizer.rank1-of-2.pt")
    with pytest.raises(FileNotFoundError, match=r"runs with \[2, 3\] processes"):
        written_by_another_world_size(directory, "optimizer.pt", 0, 4)
