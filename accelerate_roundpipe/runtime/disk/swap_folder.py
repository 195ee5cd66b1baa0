"""The run's swap folder under `offload_dir`: its own per engine, with an owner record, removed at `close()` and at
interpreter exit; leftovers of runs that died (SIGKILL, a power cut) removed at the next start.

[Note: swap folder ownership]
A folder is named `roundpipe-swap-<host>-<pid>-<token>` and holds `owner.json` (pid, host, the process's start time
as the kernel counts it, the wall-clock time it was made). When an engine makes its folder it first looks at the
other `roundpipe-swap-*` folders there: one made on this host by a process that no longer runs is a leftover and is
removed (one warning line says how many and how many bytes); one whose process runs (another engine training beside
this one) or that was made on another host (an offload_dir on a shared mount) is left alone. The start time tells a
dead run from a new process that happens to have its pid; without the record (killed between mkdir and the record's
rename) the name's host and pid decide. The swap files are never a checkpoint: nothing in them outlives the run.

The owner also holds an exclusive `flock` on the folder's `owner.lock` for as long as it lives (the kernel drops it
when the process ends, SIGKILL included), and that lock decides first: a folder whose lock another open holds is
alive, one whose lock can be taken is a leftover, whatever its pid says. A pid alone misjudges a run in another PID
namespace on the same host name (a container with host networking sharing the disk): its pid means nothing here, and
a live run's swap files were removed under it (its next `optimizer.state_dict()` failed on the missing files). The
pid and start time decide only where no lock file is (an older run, or one between its mkdir and its lock) or the
filesystem has no locks, and for this process's own folders (another engine's), which a lock cannot tell where flock
is emulated by POSIX locks (NFS), as those never bar their own process.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import secrets
import shutil
import socket
import time
import weakref

logger = logging.getLogger(__name__)

PREFIX = "roundpipe-swap-"
OWNER_RECORD = "owner.json"
OWNER_LOCK = "owner.lock"


def process_start_ticks(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (field 22 of /proc/<pid>/stat); None if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # the name in parentheses may hold spaces


def process_alive(pid: int, start_ticks: int | None = None) -> bool:
    """Does process `pid` run on this host (and, when `start_ticks` is known, is it the same process)?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it runs, as another user
    if start_ticks is None:
        return True
    now = process_start_ticks(pid)
    return now is None or now == start_ticks


def _owner(folder: str, name: str) -> tuple[str, int, int | None] | None:
    """(host, pid, start ticks) of a swap folder, from its record, else from its name; None if neither reads."""
    try:
        with open(os.path.join(folder, OWNER_RECORD)) as f:
            record = json.load(f)
        return str(record["host"]), int(record["pid"]), record.get("start_ticks")
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        host, pid, _token = name[len(PREFIX):].rsplit("-", 2)
        return host, int(pid), None
    except ValueError:
        return None


def _lock_held(folder: str) -> bool | None:
    """Is the folder's owner lock held by a live process (True), free (False: its owner is gone), or unknown (None:
    no lock file, or a filesystem without locks)?"""
    try:
        fd = os.open(os.path.join(folder, OWNER_LOCK), os.O_RDWR)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        return True if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES) else None
    finally:
        os.close(fd)  # and with it the lock just taken, if it was
    return False


def _tree_bytes(folder: str) -> int:
    total = 0
    for root, _, names in os.walk(folder):
        for name in names:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def remove_leftovers(offload_dir: str) -> list[str]:
    """Remove the swap folders in `offload_dir` left by dead runs on this host; returns their paths."""
    host = socket.gethostname()
    removed, nbytes = [], 0
    try:
        names = sorted(os.listdir(offload_dir))
    except FileNotFoundError:
        return []
    for name in names:
        path = os.path.join(offload_dir, name)
        if not name.startswith(PREFIX) or not os.path.isdir(path) or os.path.islink(path):
            continue
        owner = _owner(path, name)
        if owner is None or owner[0] != host:
            continue
        if owner[1] == os.getpid() and process_alive(owner[1], owner[2]):
            continue  # another engine of this process: where flock is emulated by POSIX locks (NFS) ours never bar us
        held = _lock_held(path)
        if held or (held is None and process_alive(owner[1], owner[2])):
            continue  # this process's own folders are alive too, unless their start time is another process's
        nbytes += _tree_bytes(path)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    if removed:
        logger.warning("RoundPipe removed %d swap folder(s) left in %s by runs that died (%.2f GiB): %s",
                       len(removed), offload_dir, nbytes / 2**30, ", ".join(os.path.basename(p) for p in removed))
    return removed


def _remove_if_owner(path: str, owner_pid: int, lock_fd: int | None) -> None:
    """Remove the folder, from the process that made it only: a forked child (a data loader's worker) that exits
    through Python's exit handlers inherits the finalizer and must not take the parent's swap files with it (nor
    its lock: the child leaves the descriptor alone, as unlocking it would unlock the parent's)."""
    if os.getpid() == owner_pid:
        shutil.rmtree(path, ignore_errors=True)
        if lock_fd is not None:
            os.close(lock_fd)


class SwapFolder:
    """This engine's folder under `offload_dir`; `path` exists until `close()` or the interpreter's exit."""

    def __init__(self, offload_dir: str) -> None:
        offload_dir = os.path.abspath(offload_dir)
        os.makedirs(offload_dir, exist_ok=True)
        self.removed_leftovers = remove_leftovers(offload_dir)
        host, pid = socket.gethostname(), os.getpid()
        self.path = os.path.join(offload_dir, f"{PREFIX}{host}-{pid}-{secrets.token_hex(4)}")
        os.mkdir(self.path, 0o700)
        lock_fd = os.open(os.path.join(self.path, OWNER_LOCK), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held until this process closes it or ends
        except OSError:  # a filesystem without locks: the record's pid and start time decide alone
            pass
        # Removed when closed, collected, or at exit, whichever comes first (weakref.finalize runs at exit too).
        self._finalizer = weakref.finalize(self, _remove_if_owner, self.path, pid, lock_fd)
        record = {"pid": pid, "host": host, "start_ticks": process_start_ticks(pid), "created": time.time()}
        staged = os.path.join(self.path, OWNER_RECORD + ".tmp")
        with open(staged, "w") as f:
            json.dump(record, f)
        os.replace(staged, os.path.join(self.path, OWNER_RECORD))  # whole or absent: never a half-written record

    def file_path(self, name: str) -> str:
        return os.path.join(self.path, name)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Remove the folder and everything in it (idempotent)."""
        self._finalizer()
