"""One bucket's optimizer step: the per-bucket steppers, gradient clipping, the step's gradient norm."""

# The modules code outside this sub-package may import (tests/test_runtime_structure.py checks it).
__all__ = ["clip", "step_norm", "steppers"]
