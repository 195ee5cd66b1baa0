"""One bucket's optimizer step: the per-bucket steppers, gradient clipping, the step's gradient norm."""
