#!/bin/bash
# Device call: GPU tests; Qwen3-1.7B s4096 b8 with the defaults (ours: engine and Trainer; anchors: HF in-GPU + Liger,
# reference RoundPipe) in one run; then the 24 GiB-cap workloads for ours (Qwen3-4B s4096 b8, Qwen3-1.7B batch 1 long).
source "$(dirname "$0")/env.sh"
timeout 60 python -m pytest tests/test_gpu.py tests/models/test_gpu_models.py -q -x -p no:cacheprovider 2>&1 | tail -4
P="python benchmarks/paths.py --out $OUT/ours.jsonl --warm 2 --iters 3"
step 75 $P --workload $W --system roundpipe-engine --nms auto
step 75 $P --workload $W --system roundpipe-trainer --nms auto
step 50 python .anchors/ingpu.py --model qwen3-1.7b --mode bf16 --liger --seqs 4096 --gb 8 --mbs 8 --iters 3 --section A1
step 70 python .anchors/rp.py --model qwen3-1.7b --seqs 4096 --gb 8 --nms 4 --iters 3 --section A2
step 80 $P --workload qwen3-4b-full-s4096-b8-cap24 --system roundpipe-engine --nms auto
step 90 python benchmarks/paths.py --out $OUT/ours.jsonl --warm 2 --iters 1 --workload qwen3-1.7b-cap24-b1 --system roundpipe-engine --nms auto --seqs 65536,131072
ls -la $OUT
