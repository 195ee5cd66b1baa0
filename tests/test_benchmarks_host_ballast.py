"""The emulated smaller host (benchmarks/host_ballast.py): the child holds the difference, and goes at the end."""

import pytest

from benchmarks import host_ballast as hb

MiB = 2**20


def test_ballast_bytes_is_what_leaves_the_target_available():
    assert hb.ballast_bytes(100 * hb.GiB, 60) == 40 * hb.GiB
    assert hb.ballast_bytes(50 * hb.GiB, 60) == 0  # already smaller: nothing held


def test_no_target_holds_nothing():
    with hb.host_ballast(None) as held:
        assert held == 0


def test_the_child_holds_the_bytes_until_the_end(monkeypatch):
    monkeypatch.setattr(hb, "available_memory_bytes", lambda: 64 * hb.GiB + 16 * MiB)
    started = []
    real_popen = hb.subprocess.Popen

    def popen(*args, **kwargs):
        started.append(real_popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(hb.subprocess, "Popen", popen)
    with hb.host_ballast(64.0) as held:
        assert held == 16 * MiB
        assert started and started[0].poll() is None  # alive while the run is
    assert started[0].returncode == 0  # gone, cleanly, once it is over


def test_a_child_that_cannot_start_is_an_error(monkeypatch):
    monkeypatch.setattr(hb, "available_memory_bytes", lambda: 64 * hb.GiB + MiB)
    monkeypatch.setattr(hb, "_CHILD", "import sys; sys.exit(3)")  # as a MemoryError would end it
    with pytest.raises(RuntimeError, match="did not start"):
        with hb.host_ballast(64.0):
            pass
