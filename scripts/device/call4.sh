#!/bin/bash
# Device call: the measured-plan GPU test; the 24 GiB-cap workloads; Qwen3-1.7B s4096 b8 three ways, longer runs.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export BENCH_COMMIT=${BENCH_COMMIT:-unknown} PYTHONWARNINGS=ignore
timeout 40 python -m pytest tests/models/test_gpu_models.py -q -x -k measured -p no:cacheprovider 2>&1 | tail -2
step() { echo "=== $*"; timeout "$@" 2>&1 | grep -E "RESULT|OOM|Traceback" | cut -c1-300 | tail -4; }
P="python benchmarks/paths.py --out $OUT/ours.jsonl"
W=qwen3-1.7b-full-s4096-b8
step 75 $P --warm 2 --iters 1 --workload qwen3-1.7b-cap24-b1 --system roundpipe-engine --nms auto --seqs 65536,131072
step 55 $P --warm 2 --iters 2 --workload qwen3-4b-full-s4096-b8-cap24 --system roundpipe-engine --nms auto
step 45 $P --warm 2 --iters 6 --workload $W --system roundpipe-engine --nms auto
step 40 $P --warm 2 --iters 5 --workload $W --system roundpipe-accelerate-loop --nms auto
step 40 $P --warm 2 --iters 5 --workload $W --system roundpipe-trainer --nms auto
