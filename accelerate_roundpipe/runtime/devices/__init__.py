"""The devices a worker computes on (CPU threads, CUDA streams), their host memory and RNG, and what tasks hand over."""

# The modules code outside this sub-package may import (tests/test_runtime_structure.py checks it).
__all__ = ["device", "factory", "payload", "pinned"]
