#!/bin/bash
# Session 3's device calls: `final` re-measures everything the gradient swap touches beside the anchors; `long` tries
# the 256K aim of the 24 GiB-cap sequence target.
part=${1:?usage: session3.sh final|long}
source "$(dirname "$0")/env.sh"
P="python benchmarks/paths.py --out $OUT/ours.jsonl"
case $part in
final)
  timeout 90 python -m pytest tests/test_gpu.py tests/models/test_gpu_models.py -q -x -p no:cacheprovider 2>&1 | tail -3
  step 70 $P --warm 2 --iters 16 --workload $W --system roundpipe-engine --nms auto --trace-dir $OUT
  step 70 $P --warm 2 --iters 16 --workload $W --system roundpipe-accelerate-loop --nms auto
  step 70 $P --warm 2 --iters 16 --workload $W --system roundpipe-trainer --nms auto
  for t in $OUT/*.json; do python -m accelerate_roundpipe.telemetry.report "$t" --seconds 8; done
  step 60 python .anchors/ingpu.py --model qwen3-1.7b --mode bf16 --liger --seqs 4096 --gb 8 --mbs 8 --section A1
  step 80 python .anchors/rp.py --model qwen3-1.7b --seqs 4096 --gb 8 --nms 4 --section A2
  step 90 $P --warm 2 --iters 6 --workload qwen3-4b-full-s4096-b8-cap24 --system roundpipe-engine --nms auto
  step 70 $P --warm 1 --iters 3 --workload qwen3-1.7b-cap24-b1 --system roundpipe-engine --nms auto --seqs 65536
  ;;
long)
  step 420 $P --warm 1 --iters 1 --workload qwen3-1.7b-cap24-b1 --system roundpipe-engine --nms auto \
    --seqs 262144 --mlp-chunk-tokens 16384
  step 100 python .anchors/rp.py --model qwen3-4b --seqs 4096 --gb 8 --nms 4 --iters 4 --cap 24 --section C2
  ;;
esac
ls -la $OUT
