"""What the host holds: parameter buckets, gradient buffers, weight versions, the host memory budget and placement."""
