"""The ways in from code: the Accelerate plugin and accelerator, `RoundPipeTrainer` and its training arguments, TRL's
SFT and DPO trainers on RoundPipe (`RoundPipeSFTTrainer`, `RoundPipeDPOTrainer`; TRL imported on first use).
(Stock scripts come in through `accelerate_roundpipe.launch`.)

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
    "RoundPipeSFTTrainer": ".trl",
    "RoundPipeDPOTrainer": ".trl",
    "CheckpointError": ".checkpoint_files",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
