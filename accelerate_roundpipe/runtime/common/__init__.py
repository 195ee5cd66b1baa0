"""Primitives every runtime layer uses: thread hand-offs, failure flags, fault injection."""

# The modules code outside this sub-package may import (tests/test_runtime_structure.py checks it).
__all__ = ["faults", "sync"]
