"""The bandwidth probe: a sequential write (fsynced) and read (its cached pages dropped first) in the offload folder,
positive rates both ways, nothing left behind."""

from __future__ import annotations

import os

import pytest

from accelerate_roundpipe.runtime.disk import bandwidth, probe_bandwidth


def test_the_probe_returns_positive_rates_and_removes_its_file(tmp_path, monkeypatch):
    calls = []
    real_fsync, real_fadvise = os.fsync, os.posix_fadvise
    monkeypatch.setattr(bandwidth.os, "fsync", lambda fd: (calls.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(bandwidth.os, "posix_fadvise",
                        lambda fd, o, n, advice: (calls.append(("fadvise", advice)), real_fadvise(fd, o, n, advice))[1])
    rates = probe_bandwidth(str(tmp_path), nbytes=3 * 2**20 + 5, block_bytes=2**20)  # a last block cut short
    assert rates.write_gbps > 0 and rates.read_gbps > 0 and rates.nbytes == 3 * 2**20 + 5
    assert calls == ["fsync", ("fadvise", os.POSIX_FADV_DONTNEED)]  # synced before dropping, dropped before reading
    assert os.listdir(tmp_path) == []
    assert "write" in str(rates) and "GB/s" in str(rates)
    with pytest.raises(ValueError, match="positive sizes"):
        probe_bandwidth(str(tmp_path), nbytes=0)
