"""The optimizer the user holds, the step policies its thread follows, and refusing steps the engine does not take."""

# The modules code outside this sub-package may import (tests/test_runtime_structure.py checks it).
__all__ = ["foreign_steps", "optimizer"]
