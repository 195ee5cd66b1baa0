#!/bin/bash
# Run in session 3 (2026-11-29, commit 743f7c4): what the GPU speed issue still needed measured.
# One part per device call (each fits the 10-minute limit): `bash scripts/device/next_session.sh caps|main|lora`.
part=${1:?usage: next_session.sh caps|main|lora}
source "$(dirname "$0")/env.sh"
P="python benchmarks/paths.py --out $OUT/ours.jsonl"
case $part in
caps)  # the 24 GiB cap: unbinding, capture cache, bounded run-ahead, working-set planner, tiled MLP are untested there
  timeout 90 python -m pytest tests/test_gpu.py tests/models/test_gpu_models.py -q -x -p no:cacheprovider 2>&1 | tail -4
  step 100 $P --warm 2 --iters 2 --workload qwen3-4b-full-s4096-b8-cap24 --system roundpipe-engine --nms auto
  # 64K untiled (the tok/s target), then 128K with the MLP tiled (the longest-sequence target): 2 steps each, the
  # first being the profiling pass. 256K would take ~2.5 min a step (attention alone), past one call's budget.
  step 90 $P --warm 1 --iters 2 --workload qwen3-1.7b-cap24-b1 --system roundpipe-engine --nms auto --seqs 65536
  step 150 $P --warm 1 --iters 1 --workload qwen3-1.7b-cap24-b1 --system roundpipe-engine --nms auto \
    --seqs 131072 --mlp-chunk-tokens 16384
  step 100 python .anchors/rp.py --model qwen3-4b --seqs 4096 --gb 8 --nms 4 --iters 2 --cap 24 --section C2
  ;;
main)  # three ways in, 8 timed steps, a trace of the engine run for the idle-between-iterations target; anchors
  step 70 $P --warm 2 --iters 8 --workload $W --system roundpipe-engine --nms auto --trace-dir $OUT
  step 70 $P --warm 2 --iters 8 --workload $W --system roundpipe-accelerate-loop --nms auto
  step 70 $P --warm 2 --iters 8 --workload $W --system roundpipe-trainer --nms auto
  for t in $OUT/*.json; do python -m accelerate_roundpipe.telemetry.report "$t" 2>&1 | tail -5; done
  step 60 python .anchors/ingpu.py --model qwen3-1.7b --mode bf16 --liger --seqs 4096 --gb 8 --mbs 8 --section A1
  step 80 python .anchors/rp.py --model qwen3-1.7b --seqs 4096 --gb 8 --nms 4 --section A2
  ;;
lora)  # Llama-3.1-8B architecture, LoRA r=16 on all linear layers, beside the reference and HF + Liger
  step 200 $P --warm 2 --iters 3 --workload llama3.1-8b-lora-s4096-b8 --system roundpipe-engine --nms auto
  step 150 python .anchors/rp.py --model llama3.1-8b --lora --seqs 4096 --gb 8 --nms 4 --iters 3 --section L2
  step 150 python .anchors/ingpu.py --model llama3.1-8b --mode lora --liger --bf16-adapters --seqs 4096 --gb 8 \
    --mbs 8,4 --iters 3 --section L1
  ;;
esac
ls -la $OUT
