"""Checks of `offload_dir` before anything is written there: a folder (or one that can be made), writable, with room
for the swap files and a margin. Each refusal names the setting, the path and the numbers.

The margin: the files are reserved at their full size when created, so the disk must hold them and still keep
`FREE_MARGIN_BYTES` plus `FREE_MARGIN_SHARE` of them free (the filesystem's own metadata, logs, the checkpoints a
run writes, other programs).
"""

from __future__ import annotations

import os
import shutil

from .errors import OffloadSettingError

GiB = 2**30
FREE_MARGIN_BYTES = 1 * GiB
FREE_MARGIN_SHARE = 0.05


def required_free_bytes(needed: int) -> int:
    """Free bytes `offload_dir` must have for `needed` bytes of swap files: the files plus the margin."""
    return needed + FREE_MARGIN_BYTES + int(FREE_MARGIN_SHARE * needed)


def _existing_ancestor(path: str) -> str:
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def _try_write(folder: str) -> None:
    """Create and remove a file in `folder`: os.access says yes to root on a read-only bind mount's permissions."""
    probe = os.path.join(folder, f".roundpipe-write-check-{os.getpid()}")
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.close(fd)
    os.unlink(probe)


def check_folder(offload_dir: str, setting: str = "offload_dir") -> str:
    """Refuse an `offload_dir` that is not a folder or not writable; returns its absolute path. A folder that does not
    exist yet is made later, by the swap folder: its nearest existing parent is checked. `setting` is how the caller
    names the setting in its messages (e.g. "RoundPipeConfig(offload_dir=...)")."""
    path = os.path.abspath(os.path.expanduser(offload_dir))
    where = f"{setting}={offload_dir!r}"
    existing = _existing_ancestor(path)
    if not os.path.isdir(existing):
        raise OffloadSettingError(f"{where}: {existing} is not a folder; point {setting} at a folder on a local disk")
    try:
        _try_write(existing)
    except OSError as error:
        raise OffloadSettingError(f"{where}: cannot write in {existing} ({error.strerror or error}); point {setting} "
                                  f"at a folder this user can write, on a local disk") from error
    return path


def check_free_space(offload_dir: str, needed_bytes: int, setting: str = "offload_dir") -> None:
    """Refuse an `offload_dir` whose disk cannot take `needed_bytes` of swap files and the margin."""
    existing = _existing_ancestor(os.path.abspath(os.path.expanduser(offload_dir)))
    usage = shutil.disk_usage(existing)
    required = required_free_bytes(needed_bytes)
    if usage.free < required:
        raise OffloadSettingError(
            f"{setting}={offload_dir!r}: the swap files need {needed_bytes / GiB:.2f} GiB and the disk under "
            f"{existing} has {usage.free / GiB:.2f} GiB free, less than the {required / GiB:.2f} GiB required (the "
            f"files plus a margin of {FREE_MARGIN_BYTES / GiB:.0f} GiB and {FREE_MARGIN_SHARE:.0%}); free space "
            f"there, point {setting} at a larger disk, or raise host_memory_budget so fewer buckets go to disk")


def check_offload_dir(offload_dir: str, needed_bytes: int, setting: str = "offload_dir") -> str:
    """Both checks: a writable folder with room for `needed_bytes` of swap files; returns its absolute path."""
    path = check_folder(offload_dir, setting)
    check_free_space(offload_dir, needed_bytes, setting)
    return path
