#!/bin/bash
# Device call: the measured-plan GPU test; the 24 GiB-cap workloads; Qwen3-1.7B s4096 b8 three ways, longer runs.
source "$(dirname "$0")/env.sh"
timeout 40 python -m pytest tests/models/test_gpu_models.py -q -x -k measured -p no:cacheprovider 2>&1 | tail -2
P="python benchmarks/paths.py --out $OUT/ours.jsonl"
step 75 $P --warm 2 --iters 1 --workload qwen3-1.7b-cap24-b1 --system roundpipe-engine --nms auto --seqs 65536,131072
step 55 $P --warm 2 --iters 2 --workload qwen3-4b-full-s4096-b8-cap24 --system roundpipe-engine --nms auto
step 45 $P --warm 2 --iters 6 --workload $W --system roundpipe-engine --nms auto
step 40 $P --warm 2 --iters 5 --workload $W --system roundpipe-accelerate-loop --nms auto
step 40 $P --warm 2 --iters 5 --workload $W --system roundpipe-trainer --nms auto
