#!/bin/bash
# Device call: GPU tests, then Qwen3-1.7B s4096 b8 (ours three ways + HF in-GPU Liger + reference RoundPipe), then
# the 24 GiB-cap workloads for ours. Results: $OUT/ours.jsonl (paths.py) and $OUT/results.jsonl (anchors).
source "$(dirname "$0")/env.sh"
timeout 100 python -m pytest tests/test_gpu.py tests/models/test_gpu_models.py -q -x -p no:cacheprovider 2>&1 | tail -8
P="python benchmarks/paths.py --out $OUT/ours.jsonl --warm 2 --iters 4"
step 100 $P --workload $W --system roundpipe-engine --nms 1,2
step 60 $P --workload $W --system roundpipe-accelerate-loop --nms 2
step 60 $P --workload $W --system roundpipe-trainer --nms 2
step 60 python .anchors/ingpu.py --model qwen3-1.7b --mode bf16 --liger --seqs 4096 --gb 8 --mbs 8 --section A1
step 80 python .anchors/rp.py --model qwen3-1.7b --seqs 4096 --gb 8 --nms 4 --section A2
step 70 $P --workload qwen3-4b-full-s4096-b8-cap24 --system roundpipe-engine --nms 4
step 90 $P --workload qwen3-1.7b-cap24-b1 --system roundpipe-engine --nms 1 --seqs 65536,131072 --iters 2
