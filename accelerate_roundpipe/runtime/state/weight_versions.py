"""Which version of one bucket's weights lives where, changed only through named transitions.

[Note: weight versions]
A trainable bucket's weights live in two host copies: the optimizer copy (`optim`, which steps write) and the compute
copy (`compute`, what `engine.module` shows). `WeightVersions` is the one owner of everything that says which copy
holds which version; its fields are private and change only through these transitions, each made by the thread that
holds the bucket's write turn (the optimizer thread), or by the caller while nothing runs (a look, a load):
- `reserve_new_version`: the caller reserved a write that will change the version readers get (an exact step, a
  lagged step's write-back); a pass's backward checks the count did not move since its forward
  ([Note: exact step without write-back]).
- `step_written`: a step wrote a new version into `optim`; with `current_for_readers` (the exact step) readers now
  read it there, else (the lagged step) they keep reading `compute` until the write-back ([Note: one-step lag]).
- `write_back`: `compute` := `optim`, which readers then read; a look's stash is dropped (the pass that read it is
  done).
- `show_newest`: a look ([Note: looking changes nothing]): the newest weights into `compute` for whoever looks, the
  version the next training pass reads kept aside as the stash.
- `restore_stash` / `forget_stash`: a checkpoint's lagged weights become the stash / weights loaded from outside
  replace it.
- `show_current`: a look at a bucket stepped on its device ([Note: optimizer placement]): the current version in
  `optim` is copied into `compute` for whoever looks, and readers go on reading `optim` (on the device, where
  the next task needs it).
- `moved_optim`: the optimizer copy moved to the bucket's home device (same contents), or into and out of a disk
  tier's staging slot ([Note: disk tier]).
- `hold_newest`: a lagged step of a bucket whose optimizer copy leaves memory after its step (the disk tier):
  the newest weights kept apart, cast to the compute dtype, for the held write-back and a look to copy from.
- `loaded_from_optim` / `loaded_from_compute` / `loaded_into_both`: weights loaded from outside into one copy are
  copied into the other (or were written into both).
- `edited_in_compute`: the user changed parameters in place after a look: the other buffers take the change
  ([Note: weight edits followed]).
What readers ask: `current(newest)` (the buffer a pass reads: its own version, or the newest for an evaluation
pass), `current_in_optim`, `stash`, `new_versions_reserved`, `changed_outside()`, and `steps` (the step counts
the torn-weights guard holds, [Note: torn weights]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def copy_with_cast(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src)`, casting on the device when one side is on a device ([Note: optimizer placement]): torch
    casts a copy between the host and a GPU on the host, through a pageable temporary (about 3 s to show Qwen3-1.7B's
    device-resident float32 copies in its bfloat16 compute copies, against a tenth of that cast on the GPU)."""
    if dst.device == src.device or dst.dtype == src.dtype:
        dst.copy_(src)
    elif src.device.type != "cpu":
        dst.copy_(src.to(dst.dtype))  # cast where the values are, then copy the narrower (or final) dtype
    else:
        dst.copy_(src.to(dst.device))  # copy as they are, then cast on the device


@dataclass
class StepCount:
    """The optimizer steps applied to a bucket's optimizer copy, and the one its compute copy was last written
    from ([Note: torn weights]). Kept apart so that a guard can hold it without the buffers; written only by
    `WeightVersions`."""

    optim: int = 0
    compute: int = 0
    # The version the read tickets hand out lives in the optimizer copy and the compute copy is older: after an
    # exact step, until someone on the host looks ([Note: exact step without write-back]).
    current_in_optim: bool = False

    @property
    def current(self) -> int:
        """The step of the version readers get (where it lives: `current_in_optim`)."""
        return self.optim if self.current_in_optim else self.compute


class WeightVersions:
    """The versions of one bucket's weights; see [Note: weight versions]."""

    def __init__(self, compute: torch.Tensor, optim: torch.Tensor | None) -> None:
        self._compute = compute
        self._optim = optim
        self._steps = StepCount()
        self._optim_version_seen = optim._version if optim is not None else 0  # after the engine's own last write
        self._stash: torch.Tensor | None = None
        self._newest: torch.Tensor | None = None  # `hold_newest`'s copy, until the write-back
        # False while the optimizer copy is a stand-in of no values (a disk bucket between its steps): the compute
        # copy then holds the newest weights unless `_newest` does
        self._optim_resident = True
        self._new_versions_reserved = 0

    def release(self) -> None:
        """The engine closed: let go of the optimizer copy and the kept versions ([Note: memory freed at close])."""
        self._optim = self._stash = self._newest = None

    # ------------------------------------------------------------------ what readers ask

    @property
    def steps(self) -> StepCount:
        return self._steps

    @property
    def current_in_optim(self) -> bool:
        """The current version lives in `optim`; `compute` is older ([Note: exact step without write-back])."""
        return self._steps.current_in_optim

    @property
    def stash(self) -> torch.Tensor | None:
        """The version the next training pass reads, kept aside while a look shows newer weights in `compute`."""
        return self._stash

    @property
    def new_versions_reserved(self) -> int:
        return self._new_versions_reserved

    def current(self, newest: bool = False) -> torch.Tensor:
        """The host buffer that holds the version a reader's ticket entitles it to (read under that ticket); with
        `newest` (an evaluation pass), the compute copy a look has filled with the newest weights instead of the
        stashed older version the next training pass reads ([Note: looking changes nothing])."""
        if self._stash is not None and not newest:
            return self._stash
        return self._optim if self._steps.current_in_optim else self._compute

    def changed_outside(self) -> bool:
        """Something other than the engine wrote the optimizer copy since the engine last did."""
        return self._optim is not None and self._optim._version != self._optim_version_seen

    # ------------------------------------------------------------------ transitions

    def reserve_new_version(self) -> None:
        self._new_versions_reserved += 1

    def step_written(self, current_for_readers: bool) -> None:
        self._optim_version_seen = self._optim._version
        self._steps.optim += 1  # [Note: torn weights]
        if current_for_readers:
            self._steps.current_in_optim = True

    def write_back(self) -> None:
        self._copy_newest_into_compute()
        self._newest = None
        self._steps.current_in_optim = False
        self._stash = None  # the pass that read it has read it ([Note: looking changes nothing])

    def show_newest(self) -> None:
        if self._stash is None:  # else this step is shown already
            self._stash = self._compute.clone()
            self._copy_newest_into_compute()

    def hold_newest(self) -> None:
        self._newest = self._optim.to(self._compute.dtype, copy=True)

    def show_current(self) -> None:
        if self._steps.compute != self._steps.optim:
            self._copy_optim_into_compute()

    def moved_optim(self, optim: torch.Tensor, resident: bool = True) -> None:
        self._optim = optim
        self._optim_resident = resident
        self._optim_version_seen = optim._version

    def restore_stash(self, tensor: torch.Tensor) -> None:
        self._stash = tensor.to(self._compute.dtype, copy=True)

    def forget_stash(self) -> None:
        self._stash = None

    def loaded_from_optim(self) -> None:
        """Weights were loaded into the optimizer copy: the compute copy follows."""
        self._copy_optim_into_compute()
        self.loaded_into_both()

    def loaded_into_both(self) -> None:
        """Both copies were written from outside with the same weights (the store being built, a load)."""
        self._optim_version_seen = self._optim._version
        self._newest = None  # the loaded weights are the newest

    def loaded_from_compute(self) -> None:
        """Weights were loaded into the compute copy: the optimizer copy follows."""
        with torch.no_grad():
            copy_with_cast(self._optim, self._compute)
        self._optim_version_seen = self._optim._version
        self._steps.compute = self._steps.optim
        self._newest = None  # the loaded weights are the newest

    def edited_in_compute(self, spans: list[tuple[int, int]]) -> None:
        """The user changed the elements `spans` ([start, stop)) of the compute copy after a look
        ([Note: weight edits followed]): every other buffer a reader may read next takes them too (the optimizer
        copy, a lagged step's held newest weights, a look's stash)."""
        with torch.no_grad():
            for start, stop in spans:
                edited = self._compute[start:stop]
                if self._optim is not None and self._optim_resident:
                    copy_with_cast(self._optim[start:stop], edited)
                for kept in (self._newest, self._stash):
                    if kept is not None:
                        kept[start:stop].copy_(edited)
        if self._optim is not None:
            self._optim_version_seen = self._optim._version

    def _copy_newest_into_compute(self) -> None:
        """The newest weights into the compute copy: what `hold_newest` kept, else the optimizer copy, unless that
        is a stand-in (the compute copy holds the newest then: an exact step wrote it, a load filled both)."""
        if self._newest is not None:
            with torch.no_grad():
                self._compute.copy_(self._newest)
        elif self._optim_resident:
            self._copy_optim_into_compute()
            return
        self._steps.compute = self._steps.optim

    def _copy_optim_into_compute(self) -> None:
        with torch.no_grad():
            copy_with_cast(self._compute, self._optim)
        self._steps.compute = self._steps.optim
