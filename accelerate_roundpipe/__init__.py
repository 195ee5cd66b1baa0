"""accelerate_roundpipe: RoundPipe pipeline training underneath the Hugging Face training API.

Importing the package starts no threads, touches no GPU and pins no memory.
"""

from .config import RoundPipeConfig
from .runtime import EngineClosedError, LaggedOptimizer, RoundPipe

__version__ = "0.1.0"

__all__ = ["RoundPipe", "RoundPipeConfig", "LaggedOptimizer", "EngineClosedError", "__version__"]
