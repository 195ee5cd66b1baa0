#!/bin/bash
# Device call: GPU tests, then Qwen3-1.7B s4096 b8 (ours three ways + HF in-GPU Liger + reference RoundPipe), then
# the 24 GiB-cap workloads for ours. Results: $OUT/ours.jsonl (paths.py) and $OUT/results.jsonl (anchors).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export BENCH_COMMIT=${BENCH_COMMIT:-unknown} PYTHONWARNINGS=ignore
timeout 100 python -m pytest tests/test_gpu.py tests/models/test_gpu_models.py -q -x -p no:cacheprovider 2>&1 | tail -8
P="python benchmarks/paths.py --out $OUT/ours.jsonl --warm 2 --iters 4"
W=qwen3-1.7b-full-s4096-b8
step() { echo "=== $*"; timeout "$@" 2>&1 | grep -E "RESULT|Error|error|OOM|re-planned|Traceback" | cut -c1-600 | tail -8; }
step 100 $P --workload $W --system roundpipe-engine --nms 1,2
step 60 $P --workload $W --system roundpipe-accelerate-loop --nms 2
step 60 $P --workload $W --system roundpipe-trainer --nms 2
step 60 python .anchors/ingpu.py --model qwen3-1.7b --mode bf16 --liger --seqs 4096 --gb 8 --mbs 8 --section A1
step 80 python .anchors/rp.py --model qwen3-1.7b --seqs 4096 --gb 8 --nms 4 --section A2
step 70 $P --workload qwen3-4b-full-s4096-b8-cap24 --system roundpipe-engine --nms 4
step 90 $P --workload qwen3-1.7b-cap24-b1 --system roundpipe-engine --nms 1 --seqs 65536,131072 --iters 2
