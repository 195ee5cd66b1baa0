"""The devices a worker computes on (CPU threads, CUDA streams), their host memory and RNG, and what tasks hand over."""
