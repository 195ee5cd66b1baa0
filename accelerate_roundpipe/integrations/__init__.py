"""The three ways in: the Accelerate plugin and accelerator, `RoundPipeTrainer`, and the launchers for stock scripts.

Names are imported on first use: `RoundPipeAccelerator` and `RoundPipeTrainer` subclass accelerate's and
transformers' classes, and importing those is not free.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "RoundPipePlugin": ".plugin",
    "RoundPipeAccelerator": ".accelerator",
    "RoundPipeTrainer": ".trainer",
    "RoundPipeTrainingArguments": ".training_args",
    "install": ".install",
    "uninstall": ".install",
    "installed": ".install",
    "run_script": ".launcher",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
