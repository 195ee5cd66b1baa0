"""accelerate_roundpipe: RoundPipe pipeline training underneath the Hugging Face training API.

Importing the package starts no threads, touches no GPU and pins no memory.
"""

from .config import RoundPipeConfig
from .models import UnsupportedModelError, wrap_model
from .runtime import EngineClosedError, LaggedOptimizer, RoundPipe, RoundPipeOptimizer

__version__ = "0.1.0"

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
    if name in _INTEGRATION_EXPORTS:
        from . import integrations

        return getattr(integrations, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
