"""Running a pass: the dispatcher, the workers, their jobs, layer copies, gradient commits and measured plans."""
