"""accelerate_roundpipe: RoundPipe pipeline training underneath the Hugging Face training API.

Importing the package starts no threads, touches no GPU and pins no memory.
"""

from .config import RoundPipeConfig
from .models import UnsupportedModelError, wrap_model
from .runtime import EngineClosedError, LaggedOptimizer, RoundPipe

__version__ = "0.1.0"

__all__ = [
    "RoundPipe",
    "RoundPipeConfig",
    "wrap_model",
    "UnsupportedModelError",
    "LaggedOptimizer",
    "EngineClosedError",
    "__version__",
]
