"""The facade: RoundPipe, the parts it is built from, its threads, pass launch and checkpoints."""

# The modules code outside this sub-package may import (tests/test_runtime_structure.py checks it).
__all__ = ["engine", "engine_checkpoint", "saved_weights"]
