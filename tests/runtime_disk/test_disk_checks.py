"""Checks before anything is written: offload_dir a folder, writable, with room for the swap files and the margin,
each refusal naming the setting and the numbers; and the default host-memory budget from the memory available."""

from __future__ import annotations

import collections
import os
import socket
import subprocess
import sys

import pytest
import torch

from accelerate_roundpipe.runtime.disk import (
    BucketLayout,
    OffloadSettingError,
    TensorSpec,
    check_offload_dir,
    folder_checks,
    memory_budget,
    open_swap,
)

GiB = 2**30
Usage = collections.namedtuple("Usage", "total used free")


def test_a_file_where_the_folder_should_be_is_refused(tmp_path):
    (tmp_path / "plain").write_text("x")
    with pytest.raises(OffloadSettingError, match=r"offload_dir='.*plain/swap': .*plain is not a folder"):
        check_offload_dir(str(tmp_path / "plain" / "swap"), 4096)


def test_a_folder_this_user_cannot_write_is_refused(tmp_path, monkeypatch):
    target = tmp_path / "ro"
    target.mkdir()
    real_open = os.open

    def refusing(path, *args, **kwargs):  # as a read-only mount answers (root passes chmod, so stand in for it)
        if os.path.dirname(str(path)) == str(target):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(folder_checks.os, "open", refusing)
    with pytest.raises(OffloadSettingError, match=r"RoundPipeConfig\(offload_dir=\.\.\.\)='.*ro': cannot write in "
                                                  r".*ro \(Permission denied\)"):
        check_offload_dir(str(target), 4096, setting="RoundPipeConfig(offload_dir=...)")


def test_too_little_free_space_is_refused_with_the_numbers(tmp_path, monkeypatch):
    monkeypatch.setattr(folder_checks.shutil, "disk_usage", lambda path: Usage(100 * GiB, 90 * GiB, 10 * GiB))
    # 10 GiB free: 8 GiB of files need 8 + 1 + 0.4 = 9.4 GiB and fit; 9 GiB need 10.45 and do not.
    assert check_offload_dir(str(tmp_path / "later"), 8 * GiB) == str(tmp_path / "later")
    with pytest.raises(OffloadSettingError) as caught:
        check_offload_dir(str(tmp_path), 9 * GiB)
    assert str(caught.value) == (
        f"offload_dir={str(tmp_path)!r}: the swap files need 9.00 GiB and the disk under {tmp_path} has 10.00 GiB "
        f"free, less than the 10.45 GiB required (the files plus a margin of 1 GiB and 5%); free space there, point "
        f"offload_dir at a larger disk, or raise host_memory_budget so fewer buckets go to disk")


def test_open_swap_refuses_before_writing_anything(tmp_path, monkeypatch):
    monkeypatch.setattr(folder_checks.shutil, "disk_usage", lambda path: Usage(2 * GiB, 2 * GiB - 4096, 4096))
    layouts = {0: BucketLayout.of([TensorSpec("optim", 1024, torch.float32)])}
    with pytest.raises(OffloadSettingError, match="the swap files need 0.00 GiB"):
        open_swap(str(tmp_path / "swap"), layouts, slots=1)
    assert os.listdir(tmp_path) == []  # no folder made, no leftover cleaned, no file reserved


def test_open_swap_makes_the_run_folder_and_close_removes_it(tmp_path):
    layouts = {k: BucketLayout.of([TensorSpec("optim", 1000 + k, torch.float32)]) for k in range(3)}
    staging = open_swap(str(tmp_path), layouts, slots=2, pin_memory=False)
    files = sorted(os.listdir(staging.files.folder.path))
    assert files == ["bucket-0.swap", "bucket-1.swap", "bucket-2.swap", "owner.json", "owner.lock"]
    staging.close()
    assert os.listdir(tmp_path) == []


def test_the_default_budget_is_memavailable_less_the_headroom(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       131072000 kB\nMemFree:         1000000 kB\nMemAvailable:   125829120 kB\n")
    no_cgroup = str(tmp_path / "no-cgroup")
    assert memory_budget.available_memory_bytes(str(meminfo), no_cgroup) == 120 * GiB
    assert memory_budget.default_host_memory_budget(120 * GiB) == 96.0  # a 128 GB machine: 20% headroom
    assert memory_budget.default_host_memory_budget(10 * GiB) == 6.0  # at least 4 GiB of headroom
    assert memory_budget.default_host_memory_budget(2 * GiB) == 0.0
    pages = {"SC_AVPHYS_PAGES": 1000, "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(memory_budget.os, "sysconf", lambda name: pages[name])
    assert memory_budget.available_memory_bytes(str(tmp_path / "absent"), no_cgroup) == 4_096_000  # no /proc


@pytest.mark.parametrize("version", [1, 2])
def test_a_containers_memory_limit_caps_what_is_available(tmp_path, version):
    """MemAvailable inside a container is the whole host's: the cgroup's limit less its usage beyond the inactive
    page cache is what this process can have before the container is killed."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemAvailable:   125829120 kB\n")  # the host: 120 GiB
    root = tmp_path / "cgroup"
    folder, prefix, inactive = (root, "memory.", "inactive_file") if version == 2 else \
        (root / "memory", "memory.", "total_inactive_file")
    folder.mkdir(parents=True)
    limit, usage = ("max", "current") if version == 2 else ("limit_in_bytes", "usage_in_bytes")
    (folder / f"{prefix}{limit}").write_text(f"{32 * GiB}\n")
    (folder / f"{prefix}{usage}").write_text(f"{12 * GiB}\n")  # 12 GiB used, 4 of them inactive page cache
    (folder / "memory.stat").write_text(f"anon {8 * GiB}\n{inactive} {4 * GiB}\n")
    assert memory_budget.available_memory_bytes(str(meminfo), str(root)) == 24 * GiB
    assert memory_budget.default_host_memory_budget(24 * GiB) == pytest.approx(19.2)
    (folder / f"{prefix}{limit}").write_text("max\n" if version == 2 else "9223372036854771712\n")  # no limit
    assert memory_budget.available_memory_bytes(str(meminfo), str(root)) == 120 * GiB


def test_a_killed_runs_leftovers_are_removed_before_the_free_space_is_counted(tmp_path, monkeypatch):
    """The run that was killed left its files on the disk: counted as used, they would refuse its own restart."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    leftover = tmp_path / f"roundpipe-swap-{socket.gethostname()}-{int(dead.stdout)}-deadbeef"
    leftover.mkdir()
    (leftover / "bucket-0.swap").write_bytes(b"\0" * 4096)
    # The disk is full while the leftover is there, and has room once it is gone.
    monkeypatch.setattr(folder_checks.shutil, "disk_usage",
                        lambda path: Usage(4 * GiB, 4 * GiB, 0) if leftover.exists() else Usage(4 * GiB, 0, 4 * GiB))
    layouts = {0: BucketLayout.of([TensorSpec("optim", 1024, torch.float32)])}
    staging = open_swap(str(tmp_path), layouts, slots=1, pin_memory=False)
    assert not leftover.exists()
    staging.close()
    assert os.listdir(tmp_path) == []
