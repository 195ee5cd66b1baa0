"""What the host holds: parameter buckets, gradient buffers, weight versions, the host memory budget and placement."""

# The modules code outside this sub-package may import (tests/test_runtime_structure.py checks it).
__all__ = ["host_resident", "host_store", "placement", "saved_input_buffers", "torn", "weight_edits"]
