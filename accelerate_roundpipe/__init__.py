"""accelerate_roundpipe: RoundPipe pipeline training underneath the Hugging Face training API.

Importing the package starts no threads, touches no GPU and pins no memory. It does not import torch either: the
engine's names are imported on first use, so the `accelerate-roundpipe` command answers a mistyped flag without
waiting seconds for torch (`RoundPipeConfig` imports it where a value needs it).
"""

import importlib
from typing import TYPE_CHECKING

from .config import RoundPipeConfig

if TYPE_CHECKING:  # what the lazy names below resolve to, for type checkers, IDEs and the API docs
    from .models import UnsupportedModelError, wrap_model
    from .runtime import EngineClosedError, LaggedOptimizer, RoundPipe, RoundPipeOptimizer

__version__ = "0.1.0"

_ENGINE_EXPORTS = {  # name: the module it lives in, imported on first use
    "RoundPipe": ".runtime",
    "RoundPipeOptimizer": ".runtime",
    "LaggedOptimizer": ".runtime",
    "EngineClosedError": ".runtime",
    "wrap_model": ".models",
    "UnsupportedModelError": ".models",
}

__all__ = [
    "RoundPipe",
    "RoundPipeConfig",
    "wrap_model",
    "UnsupportedModelError",
    "RoundPipeOptimizer",
    "LaggedOptimizer",
    "EngineClosedError",
    "__version__",
]

# The ways in (accelerate_roundpipe.integrations), imported on first use: they pull in accelerate and transformers.
_INTEGRATION_EXPORTS = ("RoundPipePlugin", "RoundPipeAccelerator", "RoundPipeTrainer", "RoundPipeTrainingArguments",
                        "RoundPipeSFTTrainer", "RoundPipeDPOTrainer", "CheckpointError")
__all__ += list(_INTEGRATION_EXPORTS)


def __getattr__(name: str):
    if name in _ENGINE_EXPORTS:
        return getattr(importlib.import_module(_ENGINE_EXPORTS[name], __name__), name)
    if name in _INTEGRATION_EXPORTS:
        from . import integrations

        return getattr(integrations, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
