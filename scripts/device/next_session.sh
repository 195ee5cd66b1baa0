#!/bin/bash
# Prepared for the next session's device time (not run yet): what the GPU speed issue still needs measured.
# Order: cheapest and most informative first; each step has its own timeout so one failure does not eat the call.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export BENCH_COMMIT=${BENCH_COMMIT:-unknown} PYTHONWARNINGS=ignore
timeout 90 python -m pytest tests/test_gpu.py tests/models/test_gpu_models.py -q -x -p no:cacheprovider 2>&1 | tail -4
step() { echo "=== $*"; timeout "$@" 2>&1 | grep -E "RESULT|OOM|re-planned|Traceback" | cut -c1-400 | tail -6; }
P="python benchmarks/paths.py --out $OUT/ours.jsonl"
W=qwen3-1.7b-full-s4096-b8
# 1. the 24 GiB cap (bounded run-ahead + working-set planner are untested there)
step 90 $P --warm 2 --iters 1 --workload qwen3-1.7b-cap24-b1 --system roundpipe-engine --nms auto --seqs 65536,131072
step 120 $P --warm 2 --iters 1 --workload qwen3-1.7b-cap24-b1 --system roundpipe-engine --nms auto --seqs 65536,131072,196608,262144 --mlp-chunk-tokens 8192
step 70 $P --warm 2 --iters 2 --workload qwen3-4b-full-s4096-b8-cap24 --system roundpipe-engine --nms auto
# 2. the main workload three ways, 8 timed steps, with a trace of the engine run for the idle-between-iterations target
step 60 $P --warm 2 --iters 8 --workload $W --system roundpipe-engine --nms auto --trace-dir $OUT
step 60 $P --warm 2 --iters 8 --workload $W --system roundpipe-accelerate-loop --nms auto
step 60 $P --warm 2 --iters 8 --workload $W --system roundpipe-trainer --nms auto
for t in $OUT/*.json; do python -m accelerate_roundpipe.telemetry.report "$t" 2>&1 | tail -5; done
# 3. LoRA (anchors in the same call)
step 120 $P --warm 2 --iters 3 --workload llama3.1-8b-lora-s4096-b8 --system roundpipe-engine --nms auto
step 120 python .anchors/rp.py --model llama3.1-8b --lora --seqs 4096 --gb 8 --nms 4 --iters 3 --section L2
