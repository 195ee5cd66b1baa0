"""The swap files of one run: one per bucket ([Note: swap file per bucket]) in the run's swap folder, made and
reserved together, closed and removed together."""

from __future__ import annotations

import re
from collections.abc import Hashable, Mapping

from .bucket_file import BucketFile
from .layout import BucketLayout
from .swap_folder import SwapFolder

_SAFE = re.compile(r"^[A-Za-z0-9_.-]+$")


class SwapFiles:
    """`layouts` (bucket key -> its layout) as files `bucket-<key>.swap` in `folder`, each reserved at its size."""

    def __init__(self, folder: SwapFolder, layouts: Mapping[Hashable, BucketLayout]) -> None:
        self.folder = folder
        self.layouts = dict(layouts)
        self._files: dict[Hashable, BucketFile] = {}
        try:
            for key, layout in self.layouts.items():
                if not _SAFE.match(str(key)):
                    raise ValueError(f"a bucket key names its swap file: {key!r} must be letters, digits, '_.-'")
                self._files[key] = BucketFile(folder.file_path(f"bucket-{key}.swap"), layout)
        except BaseException:
            self.close()
            raise

    @property
    def nbytes(self) -> int:
        return sum(layout.nbytes for layout in self.layouts.values())

    def __getitem__(self, key: Hashable) -> BucketFile:
        try:
            return self._files[key]
        except KeyError:
            raise KeyError(f"no swap file for bucket {key!r}; the files hold {list(self._files)}") from None

    def __contains__(self, key: Hashable) -> bool:
        return key in self._files

    def close(self) -> None:
        """Close every file and remove the folder (idempotent)."""
        for file in self._files.values():
            file.close()
        self.folder.close()
