# Sourced by the device-call scripts: the wheels the device lacks (Liger, the reference RoundPipe), the environment,
# and `step TIMEOUT CMD...`, which runs one benchmark with its own timeout and keeps only its result lines.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export BENCH_COMMIT=${BENCH_COMMIT:-unknown} PYTHONWARNINGS=ignore
step() { echo "=== $*"; timeout "$@" 2>&1 | grep -E "RESULT|OOM|Error|re-planned|micro-batches per|Traceback" \
  | cut -c1-500 | tail -8; }
W=qwen3-1.7b-full-s4096-b8
