"""Putting RoundPipe under stock scripts: the names a script imports are swapped before it runs.

`install()` makes `accelerate.Accelerator` the `RoundPipeAccelerator` (RoundPipe settings from `ROUNDPIPE_*`), and
`transformers.Trainer` / `transformers.TrainingArguments` the `RoundPipeTrainer` / `RoundPipeTrainingArguments` (so
a script's `HfArgumentParser(TrainingArguments)` also accepts the `--roundpipe_*` flags). Subclasses a script
defines after that (`class MyTrainer(Trainer)`) inherit RoundPipe too. Nothing in the script is edited; a script
that already imported the originals before `install()` keeps them, which is why the launcher installs first and
runs the script second.
"""

from __future__ import annotations

import contextlib
import importlib

from ..compat.launcher_swaps import SWAPPED, swap_target
from ..integrations.plugin import RoundPipePlugin

_originals: dict[tuple[str, str], object] = {}


def _targets() -> list[tuple[str, str, object]]:
    from ..integrations.accelerator import RoundPipeAccelerator
    from ..integrations.trainer import RoundPipeTrainer
    from ..integrations.training_args import RoundPipeTrainingArguments

    replacements = {"Accelerator": RoundPipeAccelerator, "Trainer": RoundPipeTrainer,
                    "TrainingArguments": RoundPipeTrainingArguments}
    return [(module_name, attribute, replacements[attribute]) for module_name, attribute in SWAPPED]


def install() -> None:
    """Swap RoundPipe in (idempotent). The `ROUNDPIPE_*` settings are checked now, before any script code runs, and
    every name swapped is checked to still hold the class RoundPipe's is built on ([Note: compatibility reaches])."""
    RoundPipePlugin()
    targets = _targets()
    currents = [swap_target(module_name, attribute, replacement) for module_name, attribute, replacement in targets]
    for (module_name, attribute, replacement), current in zip(targets, currents):
        _originals.setdefault((module_name, attribute), current)
        setattr(importlib.import_module(module_name), attribute, replacement)


def uninstall() -> None:
    """Give the modules their own classes back."""
    for (module_name, attribute), original in list(_originals.items()):
        setattr(importlib.import_module(module_name), attribute, original)
        del _originals[(module_name, attribute)]


def is_installed() -> bool:
    return bool(_originals)


@contextlib.contextmanager
def installed():
    """`install()` for the duration of a block (in-process runs of stock scripts, tests)."""
    was_installed = is_installed()
    install()
    try:
        yield
    finally:
        if not was_installed:
            uninstall()
