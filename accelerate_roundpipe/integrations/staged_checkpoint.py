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

With several ranks ([Note: one process per machine]) every rank writes into the same staging directory (its
optimizer shard, its RNG state), so one rank, the writer, prepares and renames it, and the ranks agree three times:
the directory is clean before anyone writes, everyone wrote before the rename (a rank that raised says so, and then
every rank raises and the writer discards the directory), and the rename is done before anyone goes on. A failing
rank joins the agreement too (saying it failed), so a failure never leaves the others waiting at a barrier; a rank
at another point (another agreement, a barrier of its own) makes every rank raise at once
([Note: tagged agreements] in `multi_process.py`). A rank that dies or stalls instead makes the agreement itself
fail on the others, within `wait_timeout_s` ([Note: collective timeouts]), with an error naming the checkpoint and
the peer; the writer discards the directory then too (only a killed writer leaves its `tmp-checkpoint-N/`). The
ranks must see one filesystem (or save on each node: then each node's first process is that node's writer).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from typing import Protocol

STAGING_PREFIX = "tmp-"


def staging_run_dir(final: str) -> str:
    """The directory standing in for the run directory while `final` (`<run_dir>/checkpoint-N`) is written."""
    parent, name = os.path.split(final)
    return os.path.join(parent, STAGING_PREFIX + name)


class Agreement(Protocol):
    """What the ranks of a multi-process save agree through (`multi_process.RankAgreement`): True when every rank
    said ok at the same `when` (each point of the save has one, a failing rank's included: a rank at another point
    raises, [Note: tagged agreements]); an error naming `when` and the peer when the agreement itself fails (a rank
    died or stalled past the timeout, [Note: collective timeouts])."""

    def all_ok(self, ok: bool, when: str) -> bool: ...


@contextlib.contextmanager
def staged(final: str, agreement: Agreement | None = None, is_writer: bool = True) -> Iterator[str]:
    """Yield the staging run directory; the checkpoint written as `<staging>/<name of final>` is moved to `final`
    when the block ends without an error, and discarded when it raises. With `agreement` (several ranks), every
    rank enters and leaves together, and only `is_writer` prepares, renames and discards (also when a rank is lost
    on the way: the agreement itself then raises, naming the checkpoint and the peer)."""
    staging = staging_run_dir(final)

    def prepare() -> None:
        if is_writer:
            shutil.rmtree(staging, ignore_errors=True)  # left by a process killed mid-save
            os.makedirs(staging)

    def discard() -> None:
        if is_writer:
            shutil.rmtree(staging, ignore_errors=True)

    together(agreement, prepare, f"before writing the checkpoint {final}", undo=discard)
    written = f"after writing the checkpoint {final} (discarded)"  # the point a failing rank joins too
    try:
        yield staging
    except BaseException as error:
        try:  # after the agreement: the other ranks may still be writing into the directory until then
            if agreement is not None:
                _say_failed(agreement, written, error)
        finally:
            discard()
        raise
    try:
        everyone = agreement is None or agreement.all_ok(True, written)
    except BaseException:
        discard()
        raise
    if not everyone:
        discard()
        raise RuntimeError(f"another rank failed while writing the checkpoint {final}; it was discarded (see that "
                           f"rank's error)")
    # Nobody reads the checkpoint or starts the next save before the rename.
    together(agreement, (lambda: _move_into_place(staging, final)) if is_writer else (lambda: None),
             f"while moving the checkpoint {final} into place")


def together(agreement: Agreement | None, action, when: str, undo=None) -> None:
    """Run `action` here, then agree with the other ranks that each did; a rank whose action raised still joins
    the agreement (saying it failed), so nobody waits for it. `undo` runs when this rank or another failed."""
    try:
        action()
    except BaseException as error:
        try:
            if agreement is not None:
                _say_failed(agreement, when, error)
        finally:
            if undo is not None:
                undo()
        raise
    try:
        everyone = agreement is None or agreement.all_ok(True, when)
    except BaseException:
        if undo is not None:
            undo()
        raise
    if not everyone:
        if undo is not None:
            undo()
        raise RuntimeError(f"another rank failed {when} (see that rank's error)")


def _say_failed(agreement: Agreement, when: str, error: BaseException) -> None:
    """Tell the other ranks this one failed. When that agreement fails too, a peer is gone as well, and this rank's
    error may only be its consequence (a barrier of the Trainer's that the peer left): raise the agreement's
    error, which names the peer and the checkpoint, with this rank's error as its cause."""
    try:
        agreement.all_ok(False, when)
    except BaseException as lost:
        raise lost from error


def _move_into_place(staging: str, final: str) -> None:
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
