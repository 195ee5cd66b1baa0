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

from ..integrations.plugin import RoundPipePlugin

_originals: dict[tuple[str, str], object] = {}


def _targets() -> list[tuple[str, str, object]]:
    from ..integrations.accelerator import RoundPipeAccelerator
    from ..integrations.trainer import RoundPipeTrainer
    from ..integrations.training_args import RoundPipeTrainingArguments

    return [
        ("accelerate", "Accelerator", RoundPipeAccelerator),
        ("accelerate.accelerator", "Accelerator", RoundPipeAccelerator),
        ("transformers", "Trainer", RoundPipeTrainer),
        ("transformers.trainer", "Trainer", RoundPipeTrainer),
        ("transformers", "TrainingArguments", RoundPipeTrainingArguments),
        ("transformers.training_args", "TrainingArguments", RoundPipeTrainingArguments),
    ]


def install() -> None:
    """Swap RoundPipe in (idempotent). The `ROUNDPIPE_*` settings are checked now, before any script code runs."""
    RoundPipePlugin()
    for module_name, attribute, replacement in _targets():
        module = importlib.import_module(module_name)
        _originals.setdefault((module_name, attribute), getattr(module, attribute))
        setattr(module, attribute, replacement)


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
