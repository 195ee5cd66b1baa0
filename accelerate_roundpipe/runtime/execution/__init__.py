"""Running a pass: the dispatcher, the workers, their jobs, layer copies, gradient commits and measured plans."""

# The modules code outside this sub-package may import (tests/test_runtime_structure.py checks it).
__all__ = ["adapter_switches", "deferred", "dispatch", "first_pass", "jobs", "layer_buffers", "measured_plan",
           "microbatches", "saved_input_room"]
