"""The disk tier's errors: a setting refused before anything is written, an I/O that failed or timed out (each names
the file), and a call out of the staging's protocol."""

from __future__ import annotations


class OffloadSettingError(ValueError):
    """A disk-tier setting that cannot work (a folder that is not one, not writable, too small), refused before any
    swap file is written; the message names the setting, where it points and the numbers."""


class SwapIOError(RuntimeError):
    """A read or write of a swap file failed or came up short; `path` is the file."""

    def __init__(self, message: str, path: str) -> None:
        super().__init__(message)
        self.path = path


class SwapTimeoutError(SwapIOError):
    """A read or write of a swap file did not finish within the staging's timeout (a stalled disk, a hung mount)."""


class StagingOrderError(RuntimeError):
    """A call outside the staging's protocol: an acquire out of the scheduled order, a release of a bucket not held,
    an acquire with every slot held, a call after close()."""
