"""Trainer checkpoints written under a temporary name and renamed into place once complete.

[Note: staged checkpoints]
`Trainer` writes `checkpoint-N/` file by file, and `resume_from_checkpoint=True` takes the highest-numbered
`checkpoint-*` directory it finds. A failure during the save (an error of the engine surfacing when the save flushes
the lagged step, a full disk, a killed process) used to leave a partial `checkpoint-N/` that resume then picked and
failed on ("Can't find a valid checkpoint"), instead of using the previous one. So the Trainer's whole save runs into
`tmp-checkpoint-N/checkpoint-N/` (`tmp-` so that neither resume nor rotation, which look for `checkpoint-*`, ever
see it), is removed if anything raises, and the finished `checkpoint-N/` is renamed into the run directory; then
what the Trainer decided from the run directory during the save is redone there: which checkpoint is the best
(recorded in the saved trainer state too) and the rotation of old checkpoints (`save_total_limit`). A process
killed mid-save leaves only a `tmp-checkpoint-N/`, which the next save of that step replaces.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator

STAGING_PREFIX = "tmp-"


def staging_run_dir(final: str) -> str:
    """The directory standing in for the run directory while `final` (`<run_dir>/checkpoint-N`) is written."""
    parent, name = os.path.split(final)
    return os.path.join(parent, STAGING_PREFIX + name)


@contextlib.contextmanager
def staged(final: str) -> Iterator[str]:
    """Yield the staging run directory; the checkpoint written as `<staging>/<name of final>` is moved to `final`
    when the block ends without an error, and discarded when it raises."""
    staging = staging_run_dir(final)
    shutil.rmtree(staging, ignore_errors=True)  # left by a process killed mid-save
    os.makedirs(staging)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    written = os.path.join(staging, os.path.basename(final))
    if not os.path.isdir(written):  # nothing was saved (e.g. not the main process): nothing to move
        shutil.rmtree(staging, ignore_errors=True)
        return
    replaced = None
    if os.path.exists(final):  # the same step saved again: the new one wins, the old one goes last
        replaced = staging + "-replaced"
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(final, replaced)
    os.replace(written, final)
    shutil.rmtree(staging, ignore_errors=True)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
