"""How this process's gradients and steps meet other processes' (data parallel over gloo)."""

# The modules code outside this sub-package may import (tests/test_runtime_structure.py checks it).
__all__ = ["collectives", "gloo_exchange", "gradient_exchange", "shards", "whole_buckets"]
