"""The disk tier's I/O, standalone: the run's swap folder under `offload_dir`, the checks before anything is written,
one swap file per bucket read and written with positioned I/O from a few threads, bounded staging with its
prefetcher, and the disk's measured bandwidth. Imports only the standard library and torch.

`open_swap(offload_dir, layouts, slots)` does it all in order: check the folder, remove dead runs' leftovers, check
the free space, make this run's folder and reserve the files, and return the staging over them.
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Mapping

from .bandwidth import DiskBandwidth, probe_bandwidth
from .bucket_file import BucketFile, MappedFlat
from .errors import OffloadSettingError, StagingOrderError, SwapIOError, SwapTimeoutError
from .folder_checks import check_folder, check_free_space, check_offload_dir, required_free_bytes
from .layout import ALIGN, BucketLayout, TensorSpec
from .memory_budget import available_memory_bytes, default_host_memory_budget, resident_memory_bytes
from .staging import DiskStaging
from .swap_files import SwapFiles
from .swap_folder import SwapFolder, remove_leftovers

__all__ = ["ALIGN", "BucketFile", "BucketLayout", "DiskBandwidth", "DiskStaging", "MappedFlat", "OffloadSettingError",
           "StagingOrderError", "SwapFiles", "SwapFolder", "SwapIOError", "SwapTimeoutError", "TensorSpec",
           "available_memory_bytes", "check_folder", "check_free_space", "check_offload_dir",
           "default_host_memory_budget", "open_swap", "probe_bandwidth", "remove_leftovers", "required_free_bytes",
           "resident_memory_bytes"]


def open_swap(offload_dir: str, layouts: Mapping[Hashable, BucketLayout], slots: int, *,
              setting: str = "offload_dir", **staging_options) -> DiskStaging:
    """Checked, cleaned, made and reserved: the staging over `layouts`' swap files in a new folder of this run under
    `offload_dir` (`staging_options`: DiskStaging's keyword arguments). `staging.close()` removes it all."""
    needed = sum(layout.nbytes for layout in layouts.values())
    path = check_folder(offload_dir, setting)
    if os.path.isdir(path):
        remove_leftovers(path)  # before the space is counted: a killed run's files would refuse its own restart
    check_free_space(offload_dir, needed, setting)
    folder = SwapFolder(path)
    try:
        files = SwapFiles(folder, layouts)
    except BaseException:
        folder.close()
        raise
    try:
        return DiskStaging(files, slots, **staging_options)
    except BaseException:
        files.close()
        raise
