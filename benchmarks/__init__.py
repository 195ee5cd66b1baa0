"""Benchmarks of accelerate_roundpipe on a GPU: the workloads, our three ways in (`runners/`), the command line that
runs one (`run.py`) and the collection of its records beside the anchors' (`collect.py`). How to run them on a lent
GPU: scripts/device/README.md; what was measured so far: results/README.md."""
