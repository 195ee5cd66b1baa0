"""The run's swap folder: its own, with an owner record, gone at close() and at interpreter exit; a killed run's
folder removed at the next start (one line says so), a live run's and another host's left alone."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap

from accelerate_roundpipe.runtime.disk import SwapFolder, remove_leftovers, swap_folder

# The child loads swap_folder.py by its path: importing the package would cost seconds of torch and transformers.
CHILD = textwrap.dedent(f"""
    import importlib.util, os, signal, sys
    spec = importlib.util.spec_from_file_location("swap_folder", {swap_folder.__file__!r})
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    folder = module.SwapFolder(sys.argv[1])
    open(folder.file_path("bucket-0.swap"), "wb").write(b"x" * 4096)
    print(folder.path, flush=True)
    if sys.argv[2] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if sys.argv[2] == "wait":
        sys.stdin.read()
""")


def _child(offload_dir, how: str, **kwargs):
    return subprocess.Popen([sys.executable, "-c", CHILD, str(offload_dir), how], stdout=subprocess.PIPE,
                            stdin=subprocess.PIPE, text=True, **kwargs)


def test_the_folder_has_an_owner_record_and_close_removes_it(tmp_path):
    folder = SwapFolder(str(tmp_path / "new" / "swap"))  # made, parents included
    name = os.path.basename(folder.path)
    assert name.startswith(f"roundpipe-swap-{socket.gethostname()}-{os.getpid()}-")
    with open(os.path.join(folder.path, "owner.json")) as f:
        record = json.load(f)
    assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
    assert record["start_ticks"] == swap_folder.process_start_ticks(os.getpid()) is not None
    other = SwapFolder(str(tmp_path / "new" / "swap"))  # a second engine of this process: a folder of its own
    assert other.path != folder.path and os.path.isdir(folder.path)  # and the first is not taken for a leftover
    open(folder.file_path("bucket-3.swap"), "wb").write(b"\0" * 100)
    folder.close()
    folder.close()
    assert not os.path.exists(folder.path) and folder.closed
    other.close()
    assert os.listdir(tmp_path / "new" / "swap") == []


def test_the_folder_is_removed_when_the_interpreter_exits_without_close(tmp_path):
    child = _child(tmp_path, "exit")
    path, _ = child.communicate(timeout=60)
    assert child.returncode == 0 and path.strip().startswith(str(tmp_path))
    assert not os.path.exists(path.strip()) and os.listdir(tmp_path) == []


def test_a_killed_runs_folder_is_removed_at_the_next_start_and_a_live_runs_kept(tmp_path, caplog):
    live = _child(tmp_path, "wait")  # started first: the killed run's start keeps it, as ours must
    live_path = live.stdout.readline().strip()
    killed = _child(tmp_path, "kill")
    killed_path, _ = killed.communicate(timeout=60)
    assert killed.returncode == -signal.SIGKILL and os.path.isdir(killed_path.strip())  # what a SIGKILL leaves
    assert os.path.isdir(live_path)
    # Another host's folder (an offload_dir on a shared mount) and a reused pid (this process's pid, another start).
    far = tmp_path / "roundpipe-swap-elsewhere-1-abcd1234"
    far.mkdir()
    reused = tmp_path / f"roundpipe-swap-{socket.gethostname()}-{live.pid}-0000beef"
    reused.mkdir()
    (reused / "owner.json").write_text(json.dumps({"pid": live.pid, "host": socket.gethostname(),
                                                   "start_ticks": 1, "created": 0}))
    try:
        with caplog.at_level(logging.WARNING, logger=swap_folder.__name__):
            folder = SwapFolder(str(tmp_path))
        assert sorted(folder.removed_leftovers) == sorted([killed_path.strip(), str(reused)])
        assert not os.path.exists(killed_path.strip()) and not reused.exists()
        assert os.path.isdir(live_path) and far.is_dir()
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and lines[0].startswith(f"RoundPipe removed 2 swap folder(s) left in {tmp_path} by "
                                                       "runs that died (0.00 GiB): ")
        folder.close()
    finally:
        live.communicate("", timeout=60)
    assert not os.path.exists(live_path)  # the live run removed its own at exit
    assert remove_leftovers(str(tmp_path)) == [] and os.listdir(tmp_path) == [far.name]


def test_a_folder_without_a_record_is_judged_by_its_name(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)  # a process that has exited
    orphan = tmp_path / f"roundpipe-swap-{socket.gethostname()}-{pid}-12345678"
    orphan.mkdir()
    mine = tmp_path / f"roundpipe-swap-{socket.gethostname()}-{os.getpid()}-87654321"
    mine.mkdir()  # this process's pid, no record: maybe an engine being made on another thread, kept
    (tmp_path / "roundpipe-swap-notes.txt").write_text("not a folder of ours")
    assert remove_leftovers(str(tmp_path)) == [str(orphan)]
    assert mine.is_dir() and (tmp_path / "roundpipe-swap-notes.txt").exists()


def test_a_dead_runs_folder_with_this_processs_pid_is_removed(tmp_path):
    """In a container every run may get the same pid: the record's start time tells the dead run from this one."""
    stale = tmp_path / f"roundpipe-swap-{socket.gethostname()}-{os.getpid()}-0badf00d"
    stale.mkdir()
    ticks = swap_folder.process_start_ticks(os.getpid())
    (stale / "owner.json").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                                  "start_ticks": ticks - 1, "created": 0}))
    folder = SwapFolder(str(tmp_path))
    assert folder.removed_leftovers == [str(stale)] and not stale.exists()
    folder.close()


def test_a_forked_child_leaves_the_parents_folder(tmp_path):
    """A data loader's worker forked from the training process inherits the folder's exit handler: run there, it
    must not remove the swap files the parent is still training with."""
    folder = SwapFolder(str(tmp_path))
    child = os.fork()
    if child == 0:  # the child: run the inherited handler as its exit would, then leave without pytest's handlers
        try:
            folder.close()
        finally:
            os._exit(0)
    _, status = os.waitpid(child, 0)
    assert status == 0 and os.path.isdir(folder.path)
    folder.close()
    assert not os.path.exists(folder.path)


def test_a_live_runs_lock_keeps_its_folder_whatever_its_pid_says(tmp_path):
    """A run in another PID namespace on the same host name (a container with host networking sharing the disk)
    records a pid that means nothing here: its held owner lock keeps its folder; a folder whose lock is free is a
    leftover even when its record names a live process of this host."""
    live = _child(tmp_path, "wait")
    live_path = live.stdout.readline().strip()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    record = os.path.join(live_path, "owner.json")
    with open(record) as f:
        owner = json.load(f)
    with open(record, "w") as f:  # what this host would read of a pid from another namespace
        json.dump({**owner, "pid": int(dead.stdout), "start_ticks": None}, f)
    alive = os.getppid()  # a live process of this host, not this one (whose own folders its pid decides)
    freed = tmp_path / f"roundpipe-swap-{socket.gethostname()}-{alive}-0000f00d"
    freed.mkdir()
    (freed / "owner.json").write_text(json.dumps({"pid": alive, "host": socket.gethostname(),
                                                  "start_ticks": swap_folder.process_start_ticks(alive),
                                                  "created": 0}))
    (freed / "owner.lock").write_text("")  # its owner's lock went with its process
    try:
        assert remove_leftovers(str(tmp_path)) == [str(freed)]
        assert os.path.isdir(live_path)
    finally:
        live.communicate("", timeout=60)
    assert os.listdir(tmp_path) == []


def test_another_engines_folder_in_this_process_is_kept_where_locks_never_bar_their_own_process(tmp_path,
                                                                                               monkeypatch):
    """On NFS flock is emulated by POSIX locks, which never bar the process holding them: a second engine of this
    process must still keep the first one's folder (its record names this very process)."""
    first = SwapFolder(str(tmp_path))
    monkeypatch.setattr(swap_folder.fcntl, "flock", lambda fd, how: None)  # every lock granted, as to its owner
    second = SwapFolder(str(tmp_path))
    assert second.removed_leftovers == [] and os.path.isdir(first.path)
    second.close()
    first.close()
