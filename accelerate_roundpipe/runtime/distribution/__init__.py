"""How this process's gradients and steps meet other processes' (data parallel over gloo)."""
