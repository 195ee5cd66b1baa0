#!/bin/bash
# Device call: GPU tests, then our engine on Qwen3-1.7B s4096 b8 in several variants (one process each).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export BENCH_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 150 python -m pytest tests/test_gpu.py tests/models/test_gpu_models.py -q -x -p no:cacheprovider 2>&1 | tail -15
B="python benchmarks/hf_fullft.py --model qwen3-1.7b --seq 4096 --gb 8 --warm 2 --iters 3 --out $OUT/ours.jsonl"
for v in "--nms 4 --kernels none" "--nms 4" "--nms 4 --fused-all" "--nms 8 --fused-all" "--nms 2 --fused-all --profile"; do
  echo "=== $v"; timeout 150 $B $v 2>&1 | grep -v "^\[ours" | tail -60
done
