#!/usr/bin/env bash
# Benchmarks on a lent GPU, by workload name (README.md beside this file: what each measures, how long it takes,
# what it needs and how to collect what it writes):
#
#   BENCH_COMMIT=<commit> bash scripts/device/bench.sh WORKLOAD... [anchors]
#
# Workloads: gpu-tests, host-roofline, qwen3-1.7b, cap24, lora-8b, lora-8b-cap24, long, long-256k, placement,
# placement-small, placement-cap24, small-gap, step-profile, kernels-choice, kernels-1.7b,
# small-check, small-alone, placement-small-alone, trainer-1.7b, eval-startup, eval-profiles, start-up-samples,
# steady-samples, moe-experts, moe-profile,
# moe-cap24, moe-cap24-b32, moe-cap24-merged, moe-cap24-host, gpt-oss-cap24, dense-32b-cap24, dense-32b-cap24-ab,
# moe-cap24-idle-ab, cap24-limits-ab, moe-cap24-limits-ab, call-memory, swap-rate, disk-cap24,
# disk-cap24-b64, disk-cap24-b64-short, disk-cap24-b64-pieces, disk-cap24-b64-pieces-ab, disk-cap24-b64-lagged, disk-cap24-b64-small-host, disk-cap24-host, disk-8b, disk-8b-cap24, disk-8b-cap24-b64 (the disk tier: swap files under ROUNDPIPE_OFFLOAD_DIR, default ~/.cache/roundpipe/offload),
# dense-cap24-profile, dense-layer-profile, lora-adds, lora-adds-32b, upload-chunks, buffer-reuse (buffer-reuse-moe, buffer-reuse-4b),
# look-ahead, saved-input-blocks; on a machine with two GPUs (kind nvidia-h100-x2): two-gpus, two-gpus-lora, two-gpus-moe.
# `anchors` adds, for every other workload named, the reference RoundPipe and/or
# HF + Liger in-GPU training on its settings, in the same call (from .anchors/).
# Our records go to $OUT/ours.jsonl, the anchors' to $OUT/results.jsonl, the convergence preset's to
# $OUT/convergence_*.jsonl, throw-away warm-up runs' to $OUT/warmup.jsonl, the whole output to $OUT/bench.log; the
# screen ends with one SUMMARY line per record. No run goes past BENCH_CALL_S seconds (default 585) from the start:
# the device kills a call at 600 s, and a run cut short by its own limit says so in the log.
set -u
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to the folder the results go to (the device sets it)}"
mkdir -p "$OUT"
LOG=$OUT/bench.log
: >>"$LOG"
WORKLOADS="gpu-tests host-roofline qwen3-1.7b cap24 lora-8b lora-8b-cap24 long long-256k"
WORKLOADS+=" placement placement-small placement-cap24 small-gap step-profile kernels-choice kernels-1.7b small-check small-alone placement-small-alone trainer-1.7b"
WORKLOADS+=" eval-startup eval-profiles eval-kernels start-up-samples steady-samples"
WORKLOADS+=" moe-experts moe-profile"
WORKLOADS+=" moe-cap24 moe-cap24-b32 moe-cap24-merged moe-cap24-host gpt-oss-cap24 gpt-oss-cap24-nms8 dense-32b-cap24"
WORKLOADS+=" dense-32b-cap24-ab moe-cap24-idle-ab cap24-limits-ab moe-cap24-limits-ab call-memory swap-rate"
WORKLOADS+=" disk-cap24 disk-cap24-b64 disk-cap24-b64-short disk-cap24-b64-pieces disk-cap24-b64-pieces-ab disk-cap24-b64-lagged disk-cap24-b64-small-host disk-cap24-host disk-8b disk-8b-cap24 disk-8b-cap24-b64"
WORKLOADS+=" dense-cap24-profile dense-layer-profile lora-adds lora-adds-32b upload-chunks buffer-reuse buffer-reuse-moe buffer-reuse-4b"
WORKLOADS+=" look-ahead saved-input-blocks two-gpus two-gpus-lora two-gpus-moe"
CALL_S=${BENCH_CALL_S:-585}

usage() { echo "usage: bench.sh WORKLOAD... [anchors]; workloads: $WORKLOADS" >&2; exit 2; }
[ $# -gt 0 ] || usage
anchors=0
names=()
for name in "$@"; do  # every name checked before anything runs: a typo costs no device time
  if [ "$name" = anchors ]; then
    anchors=1
  elif [[ " $WORKLOADS " == *" $name "* ]]; then
    names+=("$name")
  else
    echo "unknown workload: $name" >&2
    usage
  fi
done
[ ${#names[@]} -gt 0 ] || usage
if [ $anchors = 1 ] && [ ! -f .anchors/rp.py ]; then
  echo "anchors: copy ../shared/anchors into .anchors/ and carry it (README.md)" >&2
  exit 2
fi

# The wheels the device lacks: Liger (our engine's fused kernels when installed, and the in-GPU anchor's) and the
# reference RoundPipe with its needs. Without them our numbers do not compare with the stored ones.
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
else
  echo "warning: no .whl/: Liger kernels are off and the anchors cannot run (README.md)" | tee -a "$LOG"
fi
# NVLink multicast stays off (KINDS.md of the device tool says why).
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export BENCH_COMMIT=${BENCH_COMMIT:-unknown} PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1 OUT

# step SECONDS CMD...: one run in its own process (host peaks are per process, and the reference ends its process
# when a worker fails) under its own time limit, cut to what is left of the call's BENCH_CALL_S (a run with under 20 s
# left is skipped); the log keeps all its output, the screen its result lines and how long it took.
step() {
  local from limit=$1 left=$((CALL_S - SECONDS)) start=$SECONDS
  shift
  from=$(($(wc -l <"$LOG") + 1))
  if [ $left -lt 20 ]; then
    echo "=== skipped (the call's ${CALL_S} s are spent): $*" | tee -a "$LOG"
    return
  fi
  [ $left -lt "$limit" ] && limit=$left
  echo "=== [${SECONDS} s] $limit $*" | tee -a "$LOG"
  timeout "$limit" "$@" >>"$LOG" 2>&1
  [ $? = 124 ] && echo "timed out after $limit s" >>"$LOG"
  echo "took $((SECONDS - start)) s" >>"$LOG"
  tail -n +"$from" "$LOG" \
    | grep -E "RESULT|OOM|Error|Traceback|timed out|re-planned|passed|failed|FAILED|held-out|took" \
    | cut -c1-400 | tail -8
}

# ours SECONDS WORKLOAD SYSTEM FLAGS...: benchmarks/run.py; the engine picks the micro-batch count.
ours() {
  local seconds=$1 workload=$2 system=$3
  shift 3
  step "$seconds" python3 benchmarks/run.py --out "$OUT/ours.jsonl" --workload "$workload" --system "$system" \
    --nms auto "$@"
}
# warm_up SECONDS WORKLOAD SYSTEM FLAGS...: a throw-away run (a call's first run is slow), records apart.
warm_up() {
  local seconds=$1 workload=$2 system=$3
  shift 3
  step "$seconds" python3 benchmarks/run.py --out "$OUT/warmup.jsonl" --workload "$workload" --system "$system" \
    --nms auto "$@"
}
# step_bounds WORKLOAD: benchmarks/step_bounds.py on each trace the workload's engine runs wrote to $OUT/traces (the
# last 3 steps, its FLOPs from benchmarks/flops.py): the table on screen and in the log, a record in $OUT/bounds.jsonl.
step_bounds() {
  local t
  for t in "$OUT"/traces/"$1"-roundpipe-engine-*.json; do
    [ -f "$t" ] || continue
    python3 benchmarks/step_bounds.py "$t" --steps 3 --workload "$1" 2>&1 | tee -a "$LOG"
    python3 benchmarks/step_bounds.py "$t" --steps 3 --workload "$1" --json >>"$OUT/bounds.jsonl" 2>>"$LOG"
  done
}
reference() { step "$1" python3 .anchors/rp.py "${@:2}"; }
in_gpu_liger() { step "$1" python3 .anchors/ingpu.py --liger "${@:2}"; }

run_ours() {
  local w
  case $1 in
  gpu-tests)
    step 240 python3 -m pytest -m gpu -q -rfExX -p no:cacheprovider tests integration_tests ;;
  host-roofline)  # the host's memory bandwidth against its fused AdamW rate (the exact step's bound)
    step 120 python3 benchmarks/host_roofline.py --out "$OUT/host.jsonl" ;;
  qwen3-1.7b)  # each way in with the exact step (the default) and the lagged one; the Trainer at its defaults
    w=qwen3-1.7b-full-s4096-b8
    ours 75 $w roundpipe-engine --warm 2 --iters 8
    ROUNDPIPE_ASYNC_OPTIMIZER=true ours 75 $w roundpipe-engine --warm 2 --iters 8
    ours 75 $w roundpipe-accelerate-loop --warm 2 --iters 8
    ROUNDPIPE_ASYNC_OPTIMIZER=true ours 75 $w roundpipe-accelerate-loop --warm 2 --iters 8
    ours 75 $w roundpipe-trainer --warm 2 --iters 8 --max-grad-norm 1.0 --logging-steps 10  # its defaults
    ours 75 $w roundpipe-trainer --warm 2 --iters 8 --max-grad-norm 0 --logging-steps 10
    ROUNDPIPE_ASYNC_OPTIMIZER=true ours 75 $w roundpipe-trainer --warm 2 --iters 8 --max-grad-norm 1.0 \
      --logging-steps 10 ;;
  cap24)  # the exact step (the default) and the lagged one
    ours 120 qwen3-4b-full-s4096-b8-cap24 roundpipe-engine --warm 2 --iters 6
    ROUNDPIPE_ASYNC_OPTIMIZER=true ours 120 qwen3-4b-full-s4096-b8-cap24 roundpipe-engine --warm 2 --iters 6 ;;
  lora-8b)
    ours 200 llama3.1-8b-lora-s4096-b8 roundpipe-engine --warm 2 --iters 3 ;;
  lora-8b-cap24)  # the same on a 24 GiB card
    ours 200 llama3.1-8b-lora-s4096-b8-cap24 roundpipe-engine --warm 2 --iters 3 ;;
  long)  # 64K untiled (tok/s), 128K with the MLP tiled (length); the first step is the profiling pass
    ours 100 qwen3-1.7b-cap24-b1 roundpipe-engine --warm 1 --iters 2 --seqs 65536
    ours 180 qwen3-1.7b-cap24-b1 roundpipe-engine --warm 1 --iters 1 --seqs 131072 --mlp-chunk-tokens 16384 ;;
  long-256k)  # about 75 s a step: a call of its own
    ours 480 qwen3-1.7b-cap24-b1 roundpipe-engine --warm 1 --iters 1 --seqs 262144 --mlp-chunk-tokens 16384 ;;
  placement)  # issue 26: optimizer state on the GPU where it fits (auto) against all on the host, after a warm-up
    w=qwen3-1.7b-full-s4096-b8
    warm_up 60 $w roundpipe-engine --warm 1 --iters 1 --roundpipe optimizer_placement=auto
    for p in auto host; do  # the Trainer at its defaults: exact, max_grad_norm=1.0, logging_steps=10
      ours 75 $w roundpipe-trainer --warm 2 --iters 8 --max-grad-norm 1.0 --logging-steps 10 \
        --roundpipe optimizer_placement=$p
    done
    ours 75 $w roundpipe-engine --warm 2 --iters 8 --roundpipe optimizer_placement=auto
    ours 75 $w roundpipe-engine --warm 2 --iters 8 --roundpipe optimizer_placement=host
    ROUNDPIPE_ASYNC_OPTIMIZER=true ours 75 $w roundpipe-engine --warm 2 --iters 8 \
      --roundpipe optimizer_placement=host ;;
  placement-small)  # the 168M convergence preset, 300 steps from scratch: the plain Trainer in GPU memory (twice,
    # the first a warm-up), RoundPipeTrainer at its default placement and all on the host; the same arguments
    step 290 python3 benchmarks/convergence.py --preset gpu --regimes scratch --systems hf,hf \
      --variant auto:optimizer_placement=auto --variant host:optimizer_placement=host --out "$OUT" ;;
  small-gap)  # issue 26 item 6: the 168M preset (100 steps, auto) beside the plain Trainer, with CPython's 5 ms
    # thread switch interval and with 1 ms (every system of a run alike)
    for s in 0.005 0.001; do
      step 150 python3 benchmarks/convergence.py --preset gpu --regimes scratch --systems hf --steps 100 \
        --eval-every 1000 --switch-interval $s --variant "auto-switch$s:optimizer_placement=auto" --out "$OUT"
    done ;;
  step-profile)  # issue 26 item 6: torch.profiler over steps 40-50 of the 168M preset, every thread: the plain
    # Trainer, RoundPipeTrainer (auto) and the same without Liger kernels; summaries on screen, traces in $OUT/profile
    step 240 python3 benchmarks/step_profile.py --preset gpu --steps 60 --window 40:50 --systems hf \
      --variant auto:optimizer_placement=auto --variant no-liger:optimizer_placement=auto,kernels=none \
      --out "$OUT/profile" ;;
  kernels-choice)  # which layers `kernels=auto` should run: Liger's fused kernels against the model's own, on the
    # 168M preset (host-bound: 100 steps beside the plain Trainer, and a profile) and on Qwen3-1.7B (the Trainer's
    # defaults); each setting in a process of its own (Liger patches the model family's RoPE for the process)
    step 100 python3 benchmarks/convergence.py --preset gpu --regimes scratch --systems hf --steps 100 \
      --eval-every 1000 --variant liger:kernels=liger --out "$OUT"
    step 80 python3 benchmarks/convergence.py --preset gpu --regimes scratch --systems "" --steps 100 \
      --eval-every 1000 --variant own-layers:kernels=none --out "$OUT"
    step 80 python3 benchmarks/convergence.py --preset gpu --regimes scratch --systems "" --steps 100 \
      --eval-every 1000 --switch-interval 0.001 --variant own-layers-switch0.001:kernels=none --out "$OUT"
    step 100 python3 benchmarks/step_profile.py --preset gpu --steps 60 --window 40:50 --systems "" \
      --variant own-layers:kernels=none --out "$OUT/profile"
    run_ours kernels-1.7b ;;
  kernels-1.7b)  # Qwen3-1.7B, RoundPipeTrainer at its defaults, Liger against the model's own layers
    for k in liger none; do
      ours 75 qwen3-1.7b-full-s4096-b8 roundpipe-trainer --warm 2 --iters 8 --max-grad-norm 1.0 --logging-steps 10 \
        --kernels $k
    done ;;
  small-check)  # the 168M preset, 100 steps beside the plain Trainer: RoundPipeTrainer at its defaults and with
    # Liger's kernels (each in its own process)
    step 100 python3 benchmarks/convergence.py --preset gpu --regimes scratch --systems hf --steps 100 \
      --eval-every 1000 --variant default:optimizer_placement=auto --out "$OUT"
    step 80 python3 benchmarks/convergence.py --preset gpu --regimes scratch --systems "" --steps 100 \
      --eval-every 1000 --variant liger:kernels=liger --out "$OUT" ;;
  small-alone)  # the 168M preset: is RoundPipeTrainer slower in a process that trained the plain Trainer first?
    # A profile of it alone, then 100 steps after the plain Trainer in one process and alone in another
    step 100 python3 benchmarks/step_profile.py --preset gpu --steps 60 --window 40:50 --systems "" \
      --variant auto:optimizer_placement=auto --out "$OUT/profile"
    step 100 python3 benchmarks/convergence.py --preset gpu --regimes scratch --systems hf --steps 100 \
      --eval-every 1000 --variant after-hf:optimizer_placement=auto --out "$OUT"
    step 80 python3 benchmarks/convergence.py --preset gpu --regimes scratch --systems "" --steps 100 \
      --eval-every 1000 --variant alone:optimizer_placement=auto --out "$OUT" ;;
  eval-kernels)  # beside eval-startup: is the engine's evaluation host-bound by Liger's launches? The plain Trainer
    # with Liger (use_liger_kernel) and RoundPipeTrainer without (kernels=none), each in its own process
    step 90 python3 benchmarks/convergence.py --preset gpu --regimes scratch --systems hf-liger --out "$OUT"
    step 110 python3 benchmarks/convergence.py --preset gpu --regimes scratch --systems "" \
      --variant no-kernels:kernels=none --out "$OUT" ;;
  eval-startup)  # issue 31 item 10: what a user waits for on the 168M preset (300 steps, an evaluation every 50):
    # the whole train() and each evaluate(), the plain Trainer and RoundPipeTrainer at its defaults, each in its own
    # process after a warm-up of both (eval-profiles after it: where an evaluation and the start-up go)
    step 70 python3 benchmarks/convergence.py --preset gpu --regimes scratch --systems hf --steps 20 \
      --eval-every 1000 --variant warm-up:optimizer_placement=auto --out "$OUT/warmup"
    step 90 python3 benchmarks/convergence.py --preset gpu --regimes scratch --systems hf --out "$OUT"
    step 110 python3 benchmarks/convergence.py --preset gpu --regimes scratch --systems "" \
      --variant defaults: --out "$OUT" ;;
  eval-profiles)  # after eval-startup: torch.profiler + cProfile over an evaluation and over the start-up
    step 80 python3 benchmarks/step_profile.py --preset gpu --steps 30 --window 0:20 --phase evaluate --systems hf \
      --variant defaults: --out "$OUT/profile"
    step 80 python3 benchmarks/step_profile.py --preset gpu --steps 20 --window 0:3 --phase start-up --systems hf \
      --variant defaults: --out "$OUT/profile" ;;
  start-up-samples)  # after eval-startup (its warm-up): where the wall time of the start-up (train() to the end of
    # step 2) and of an evaluation during training (after step 50) goes, each thread's Python stack sampled every
    # millisecond at full speed (no profiler), the plain Trainer and RoundPipeTrainer at its defaults
    step 80 python3 benchmarks/step_profile.py --preset gpu --steps 4 --window 0:2 --phase start-up --systems hf \
      --variant defaults: --sampler 1 --out "$OUT/samples"
    step 80 python3 benchmarks/step_profile.py --preset gpu --steps 60 --window 0:50 --phase evaluate --systems hf \
      --variant defaults: --sampler 1 --out "$OUT/samples" ;;
  placement-small-alone)  # issue 26's small-model target, each system in a process of its own (a user trains one
    # model a process; a RoundPipe run after the plain Trainer in one process was 12% slower a step, unexplained),
    # after a warm-up of both (Liger's Triton kernels compiled into the cache, as on a user's second run)
    step 70 python3 benchmarks/convergence.py --preset gpu --regimes scratch --systems hf --steps 20 \
      --eval-every 1000 --variant warm-up:optimizer_placement=auto --out "$OUT/warmup"
    step 90 python3 benchmarks/convergence.py --preset gpu --regimes scratch --systems hf --out "$OUT"
    step 110 python3 benchmarks/convergence.py --preset gpu --regimes scratch --systems "" \
      --variant auto:optimizer_placement=auto --out "$OUT"
    step 120 python3 benchmarks/convergence.py --preset gpu --regimes scratch --systems "" \
      --variant host:optimizer_placement=host --out "$OUT"
    step 110 python3 benchmarks/convergence.py --preset gpu --regimes scratch --systems "" --switch-interval 0.001 \
      --variant auto-switch0.001:optimizer_placement=auto --out "$OUT" ;;
  moe-experts)  # issue 32 item 2: Qwen3-30B-A3B's layer shapes, 4 layers, bf16: plain HF with each experts
    # implementation, plain PEFT LoRA in GPU memory, the engine's LoRA with each (benchmarks/moe_experts.py)
    step 170 python3 benchmarks/moe_experts.py --out "$OUT/ours.jsonl" ;;
  steady-samples)  # after eval-startup (its warm-up): where the wall time of steady steps goes (steps 60-160 of 160),
    # each thread's Python stack sampled every 2 ms at full speed, the plain Trainer and RoundPipeTrainer at its defaults
    step 90 python3 benchmarks/step_profile.py --preset gpu --steps 160 --window 60:160 --phase steps --systems hf \
      --variant defaults: --sampler 2 --out "$OUT/samples" ;;
  saved-input-blocks)  # [Note: saved inputs in pooled blocks] beside torch's page-locked cache (the default), each in
    # its own process: Qwen3-4B full fine-tune b8 under the cap (80 MiB inputs: 128 MiB blocks in torch's cache)
    ours 120 qwen3-4b-full-s4096-b8-cap24 roundpipe-engine --warm 2 --iters 4
    ours 120 qwen3-4b-full-s4096-b8-cap24 roundpipe-engine --warm 2 --iters 4 --pooled-saved-inputs ;;
  two-gpus)  # one process, two GPUs as RoundPipe's worker pool (the paper's setting; kind nvidia-h100-x2): the
    # multi-GPU tests, then Qwen3-4B full fine-tune b8 with every GPU capped at 24 GiB, on one GPU and on two
    step 200 python3 -m pytest -m gpu -q -rfExX -p no:cacheprovider tests/test_multi_gpu.py \
      integration_tests/test_gpu_two_gpus.py
    ours 120 qwen3-4b-full-s4096-b8-cap24 roundpipe-engine --warm 2 --iters 4 --devices cuda:0
    ours 120 qwen3-4b-full-s4096-b8-cap24 roundpipe-engine --warm 2 --iters 4 --devices cuda:0,cuda:1 ;;
  two-gpus-lora)  # Llama-3.1-8B LoRA r16 b8, every GPU capped at 24 GiB, on one GPU and on two
    ours 200 llama3.1-8b-lora-s4096-b8-cap24 roundpipe-engine --warm 2 --iters 3 --devices cuda:0
    ours 200 llama3.1-8b-lora-s4096-b8-cap24 roundpipe-engine --warm 2 --iters 3 --devices cuda:0,cuda:1 ;;
  two-gpus-moe)  # Qwen3-30B-A3B LoRA r16 (experts included) b8, every GPU capped at 24 GiB, on two GPUs
    ours 240 qwen3-30b-a3b-lora-s4096-b8-cap24 roundpipe-engine --warm 2 --iters 4 --devices cuda:0,cuda:1 ;;
  moe-profile)  # issue 32: where an MoE step's GPU time goes, by kind of kernel (benchmarks/moe_layer_profile.py):
    # the 4-layer Qwen3-30B-A3B-shaped model at one micro-batch of the b32 run (4 x 4096), plain HF, PEFT in GPU
    # memory, the engine's LoRA
    step 120 python3 benchmarks/moe_layer_profile.py --batch 4 --out "$OUT/ours.jsonl" ;;
  trainer-1.7b)  # Qwen3-1.7B s4096 b8, RoundPipeTrainer at its defaults (exact, clip 1.0, logging 10)
    ours 75 qwen3-1.7b-full-s4096-b8 roundpipe-trainer --warm 2 --iters 8 --max-grad-norm 1.0 --logging-steps 10 \
      --roundpipe optimizer_placement=auto ;;
  moe-cap24)  # Qwen3-30B-A3B LoRA r16 on q,k,v,o,gate,up,down (PEFT puts gate/up/down on the fused experts) on a
    # 24 GiB card, built with the cap lifted and kept on the host; the engine at its defaults (the exact step)
    # with a timeline trace of its steps (gzipped at the end of the call)
    ours 240 qwen3-30b-a3b-lora-s4096-b8-cap24 roundpipe-engine --warm 2 --iters 4 --trace-dir "$OUT/traces" ;;
  moe-cap24-b32)  # the same at b32 (issue 32's second MoE target: >= 0.4 of the limit), 8 micro-batches of 4 rows, traced
    # (the first pass's default, 2 per device, would be 2 of 16 rows: out of memory before anything is measured)
    step 240 python3 benchmarks/run.py --out "$OUT/ours.jsonl" --workload qwen3-30b-a3b-lora-s4096-b32-cap24 \
      --system roundpipe-engine --nms 8 --warm 1 --iters 2 --trace-dir "$OUT/traces" ;;
  moe-cap24-merged)  # the same as moe-cap24 with PEFT's own computation of the experts' LoRA (the merged weight per
    # call) in place of the factored one ([Note: factored LoRA on experts]), for the two side by side
    ours 240 qwen3-30b-a3b-lora-s4096-b8-cap24 roundpipe-engine --warm 2 --iters 4 --peft-merged-experts ;;
  moe-cap24-host)  # the same at b8 with every bucket's optimizer state on the host (auto puts 12 GiB on the card)
    ours 240 qwen3-30b-a3b-lora-s4096-b8-cap24 roundpipe-engine --warm 2 --iters 4 \
      --roundpipe optimizer_placement=host ;;
  gpt-oss-cap24)  # GPT-OSS-20B (bf16) LoRA on the experts' parameters and the attention, the same way
    ours 240 gpt-oss-20b-lora-s4096-b8-cap24 roundpipe-engine --warm 2 --iters 3 ;;  # 2 warm-up: dense-32b-cap24
  gpt-oss-cap24-nms8)  # the same at 8 micro-batches of 1 row: eager attention's scores are 2 GiB a row per layer
    # (64 heads x 4096^2 in bf16), and the first pass's default of 2 (4 rows each) ran out of memory at 82d9581
    ours 240 gpt-oss-20b-lora-s4096-b8-cap24 roundpipe-engine --warm 1 --iters 2 --nms 8 ;;
  dense-32b-cap24)  # Qwen3-32B LoRA on every linear, the same way; 2 warm-up steps: with 1, the first timed step is
    # the measured plan's first pass (17.6 s against 12.6 s later: the 2,005 tok/s of d4de784 was that)
    ours 240 qwen3-32b-lora-s4096-b8-cap24 roundpipe-engine --warm 2 --iters 3 ;;
  dense-32b-cap24-ab)  # the 32B at 2,005 tok/s at d4de784 against 2,479 at 3e3b28b: the default with 2 warm-up
    # steps (the first timed step is no longer the new plan's first pass), then without the first-pass regroup,
    # then with idle weight buffers kept as before
    w=qwen3-32b-lora-s4096-b8-cap24
    ours 185 $w roundpipe-engine --warm 2 --iters 3
    ours 185 $w roundpipe-engine --warm 2 --iters 3 --one-layer-first-pass
    ours 185 $w roundpipe-engine --warm 2 --iters 3 --keep-idle-buffers ;;
  moe-cap24-idle-ab)  # [Note: idle buffers given back at the prefetch] on the MoE step (the H200 trace at d4de784
    # waits about 6 ms for weights at every second backward stage; the H100's at 0b93cdb did not): the default, then
    # with idle weight buffers kept as before
    ours 240 qwen3-30b-a3b-lora-s4096-b8-cap24 roundpipe-engine --warm 2 --iters 4 --trace-dir "$OUT/traces"
    ours 240 qwen3-30b-a3b-lora-s4096-b8-cap24 roundpipe-engine --warm 2 --iters 4 --keep-idle-buffers \
      --trace-dir "$OUT/traces/kept"
    for t in "$OUT"/traces/qwen3-30b-a3b-*.json "$OUT"/traces/kept/*.json; do  # each one's tasks and weight waits
      [ -f "$t" ] && python3 benchmarks/step_bounds.py "$t" --steps 3 --workload qwen3-30b-a3b-lora-s4096-b8-cap24 \
        2>&1 | tee -a "$LOG"
    done ;;
  cap24-limits-ab)  # [Note: limits in allocated bytes] on the 4B full fine-tune (11 GiB of optimizer state on the
    # card): the default, then the limits without the placed state (no saved input kept, no look-ahead), both traced
    w=qwen3-4b-full-s4096-b8-cap24
    ours 150 $w roundpipe-engine --warm 2 --iters 6 --trace-dir "$OUT/traces"
    ours 150 $w roundpipe-engine --warm 2 --iters 6 --limits-without-placed-state --trace-dir "$OUT/traces/before"
    for t in "$OUT"/traces/$w-*.json "$OUT"/traces/before/*.json; do
      [ -f "$t" ] && python3 benchmarks/step_bounds.py "$t" --steps 3 --workload $w 2>&1 | tee -a "$LOG"
    done ;;
  moe-cap24-limits-ab)  # the same A/B on the MoE step (auto places about 12 GiB of its state on the card)
    w=qwen3-30b-a3b-lora-s4096-b8-cap24
    ours 240 $w roundpipe-engine --warm 2 --iters 4 --trace-dir "$OUT/traces"
    ours 240 $w roundpipe-engine --warm 2 --iters 4 --limits-without-placed-state --trace-dir "$OUT/traces/before"
    for t in "$OUT"/traces/$w-*.json "$OUT"/traces/before/*.json; do
      [ -f "$t" ] && python3 benchmarks/step_bounds.py "$t" --steps 3 --workload $w 2>&1 | tee -a "$LOG"
    done ;;
  call-memory)  # GPU memory at every call boundary beside the measured plan's stage bytes (benchmarks/call_memory.py):
    # Qwen3-4B full b8 under the cap, one call a step and 8 calls a step, each in its own process
    step 200 python3 benchmarks/call_memory.py --workload qwen3-4b-full-s4096-b8-cap24 --call-rows 8 \
      --accumulation 1,8 --steps 3 --out "$OUT/call_memory.jsonl" ;;
  swap-rate)  # the disk tier's reads and writes through the page cache (benchmarks/swap_rate.py): threads against
    # files for raw pwrite/pread, then the engine's staging at 4 and 8 I/O threads, one file a bucket and 8 pieces
    step 150 python3 benchmarks/swap_rate.py --gib 4 --buckets 8 --bucket-gib 1 --io-threads 4,8 --pieces 1,8 \
      --out "$OUT/swap_rate.jsonl" ;;
  disk-cap24)  # the disk tier under the 24 GiB cap: Qwen3-4B full fine-tune, exact step, with host_memory_budget=24
    # (optimizer copies and states past it in swap files), then the same run with nothing on disk (the default
    # budget); the engine's placement otherwise (auto: some state on the GPU). Each record holds the disk's probe.
    w=qwen3-4b-full-s4096-b8-cap24
    ours 330 $w roundpipe-engine --warm 2 --iters 4 --disk-probe --roundpipe host_memory_budget=24
    ours 150 $w roundpipe-engine --warm 2 --iters 4 --disk-probe ;;
  disk-cap24-b64)  # issue 33's target as it reads: the same pair at a global batch of 64 x 4096 (accumulation: 8
    # forward_backward calls of 8 rows, one step), the disk run first; 2 warm-up + 2 timed steps each (a step is
    # about 20 s of passes and the disk's step)
    w=qwen3-4b-full-s4096-b64-cap24
    ours 320 $w roundpipe-engine --warm 2 --iters 2 --disk-probe --roundpipe host_memory_budget=24
    ours 250 $w roundpipe-engine --warm 2 --iters 2 --disk-probe ;;
  disk-cap24-b64-short)  # disk-cap24-b64 for a call with less device time left: the default budget first (the
    # baseline), then the disk run; 1 warm-up + 2 timed steps each
    w=qwen3-4b-full-s4096-b64-cap24
    ours 170 $w roundpipe-engine --warm 1 --iters 2 --disk-probe
    ours 300 $w roundpipe-engine --warm 1 --iters 2 --disk-probe --roundpipe host_memory_budget=24 ;;
  disk-cap24-b64-pieces)  # issue 33's 4B target alone: the baseline (default host budget) and the disk run with swap
    # files in pieces, in one call; 1 warm-up + 2 timed steps each (disk-cap24-b64-pieces-ab adds the files as before)
    w=qwen3-4b-full-s4096-b64-cap24
    ours 150 $w roundpipe-engine --warm 1 --iters 2 --disk-probe
    ours 215 $w roundpipe-engine --warm 1 --iters 2 --disk-probe --roundpipe host_memory_budget=24 ;;
  disk-cap24-b64-pieces-ab)  # [Note: swap files in pieces] on issue 33's 4B target: the baseline (default host
    # budget), the disk run (swap files in pieces, up to 8 I/O threads), then the disk run as before (one file a
    # bucket, 4 I/O threads); 1 warm-up + 2 timed steps each
    w=qwen3-4b-full-s4096-b64-cap24
    ours 150 $w roundpipe-engine --warm 1 --iters 2 --disk-probe
    ours 215 $w roundpipe-engine --warm 1 --iters 2 --disk-probe --roundpipe host_memory_budget=24
    ours 215 $w roundpipe-engine --warm 1 --iters 2 --disk-probe --roundpipe host_memory_budget=24 --one-swap-file \
      --four-io-threads ;;
  disk-cap24-b64-lagged)  # beside disk-cap24-b64: the same disk run with the step one step late
    # (async_optimizer), whose disk reads and writes run under the next step's 8 calls instead of between them
    ROUNDPIPE_ASYNC_OPTIMIZER=true ours 320 qwen3-4b-full-s4096-b64-cap24 roundpipe-engine --warm 2 --iters 2 \
      --disk-probe --roundpipe host_memory_budget=24 ;;
  disk-cap24-b64-small-host)  # the disk run of disk-cap24-b64 on an emulated 64 GB workstation: a ballast process
    # leaves 60 GiB available, so the page cache cannot hold the swap files (on this machine's disk, under 1 GB/s,
    # a step is the disk's: minutes); 1 warm-up + 1 timed step
    ours 560 qwen3-4b-full-s4096-b64-cap24 roundpipe-engine --warm 1 --iters 1 --disk-probe \
      --roundpipe host_memory_budget=24 --host-available-gib 60 ;;
  disk-cap24-host)  # the same two with every bucket's state off the GPU: all on disk (24 GiB holds the compute
    # copies and gradients only) against all on the host
    w=qwen3-4b-full-s4096-b8-cap24
    ours 330 $w roundpipe-engine --warm 2 --iters 4 --disk-probe --roundpipe host_memory_budget=24 \
      --roundpipe optimizer_placement=host
    ours 150 $w roundpipe-engine --warm 2 --iters 4 --disk-probe --roundpipe optimizer_placement=host ;;
  disk-8b)  # Llama-3.1-8B full fine-tune with host_memory_budget=96 (its 134 GiB of host state do not fit)
    ours 540 llama3.1-8b-full-s4096-b8 roundpipe-engine --warm 2 --iters 3 --disk-probe \
      --roundpipe host_memory_budget=96 ;;
  disk-8b-cap24)  # issue 33's target: the same on a 24 GiB card, where every optimizer state is off the GPU (about
    # 120 GB of host state against the 96 GiB budget): one warm-up and one timed step fit a call
    ours 560 llama3.1-8b-full-s4096-b8-cap24 roundpipe-engine --warm 1 --iters 1 --disk-probe \
      --roundpipe host_memory_budget=96 ;;
  disk-8b-cap24-b64)  # the same at issue 33's global batch of 64 x 4096 (8 calls of 8 rows a step: every bucket's
    # gradient held on the host until the step); one warm-up and one timed step
    ours 560 llama3.1-8b-full-s4096-b64-cap24 roundpipe-engine --warm 1 --iters 1 --disk-probe \
      --roundpipe host_memory_budget=96 ;;
  dense-cap24-profile)  # issue 32 item 4, dense under the cap: Qwen3-4B full fine-tune and Llama-3.1-8B LoRA on a
    # 24 GiB card, the engine at its defaults, traced; where each step's time goes against the compute, PCIe and
    # host-step bounds (benchmarks/step_bounds.py on each trace, $OUT/bounds.jsonl)
    ours 150 qwen3-4b-full-s4096-b8-cap24 roundpipe-engine --warm 2 --iters 3 --trace-dir "$OUT/traces"
    ours 200 llama3.1-8b-lora-s4096-b8-cap24 roundpipe-engine --warm 2 --iters 3 --trace-dir "$OUT/traces"
    step_bounds qwen3-4b-full-s4096-b8-cap24
    step_bounds llama3.1-8b-lora-s4096-b8-cap24 ;;
  dense-layer-profile)  # issue 32 item 4: the kernels of 4 decoder layers at one micro-batch of the cap24 runs
    # (4 x 4096) on the whole GPU, the engine beside HF + Liger with and without checkpointing
    # (benchmarks/dense_layer_profile.py): Qwen3-4B full fine-tune, Llama-3.1-8B-shaped LoRA r16
    step 150 python3 benchmarks/dense_layer_profile.py --model qwen3-4b --out "$OUT/ours.jsonl"
    step 150 python3 benchmarks/dense_layer_profile.py --model llama3.1-8b --lora --out "$OUT/ours.jsonl" ;;
  lora-adds)  # LoRA's product added inside one GEMM ([Note: LoRA added in the GEMM]) against PEFT's own forward on the
    # layer copies: 4 Llama-3.1-8B-shaped layers' kernels (the whole GPU), then the 8B LoRA on a 24 GiB card both
    # ways, then HF + Liger in GPU memory under the same cap (issue 32's 1.3x target), all in one call
    step 150 python3 benchmarks/dense_layer_profile.py --model llama3.1-8b --lora --out "$OUT/ours.jsonl" \
      --systems hf-liger-ckpt,engine-stages,engine-stages-peft-adds
    w=llama3.1-8b-lora-s4096-b8-cap24
    ours 150 $w roundpipe-engine --warm 2 --iters 3
    ours 150 $w roundpipe-engine --warm 2 --iters 3 --peft-lora-adds
    in_gpu_liger 100 --model llama3.1-8b --mode lora --bf16-adapters --seqs 4096 --gb 8 --mbs 2,1 --iters 3 --cap 24 \
      --section lora-8b-cap24-liger ;;
  lora-adds-32b)  # the same A/B on Qwen3-32B LoRA under the cap (issue 32's 0.5-of-the-limit target)
    ours 270 qwen3-32b-lora-s4096-b8-cap24 roundpipe-engine --warm 1 --iters 2
    ours 270 qwen3-32b-lora-s4096-b8-cap24 roundpipe-engine --warm 1 --iters 2 --peft-lora-adds ;;
  upload-chunks)  # [Note: parameter uploads in chunks] A/B: Qwen3-30B-A3B LoRA b8 under the cap (its backward's
    # inputs waited behind whole-bucket uploads) and Llama-3.1-8B LoRA, chunked (the default) and one copy a bucket,
    # traced (`python3 benchmarks/step_bounds.py TRACE` for each: every task's time and weight waits)
    ours 240 qwen3-30b-a3b-lora-s4096-b8-cap24 roundpipe-engine --warm 2 --iters 4 --trace-dir "$OUT/traces"
    ours 240 qwen3-30b-a3b-lora-s4096-b8-cap24 roundpipe-engine --warm 2 --iters 4 --whole-bucket-uploads \
      --trace-dir "$OUT/traces/whole"
    ours 200 llama3.1-8b-lora-s4096-b8-cap24 roundpipe-engine --warm 2 --iters 3
    ours 200 llama3.1-8b-lora-s4096-b8-cap24 roundpipe-engine --warm 2 --iters 3 --whole-bucket-uploads ;;
  buffer-reuse)  # [Note: weight buffers reused] A/B under the cap, beside `moe-cap24` (the default, traced, in the
    # same call): Qwen3-30B-A3B LoRA b8 with every task's buffers back to the caching allocator (`--no-buffer-reuse`;
    # the forward stalled at every stage boundary on the allocator's wait for the GPU), and Qwen3-4B full fine-tune
    # b8 reused (the default) and not
    run_ours buffer-reuse-moe; run_ours buffer-reuse-4b ;;
  buffer-reuse-moe)  # the MoE half of buffer-reuse (for `moe-cap24 buffer-reuse-moe anchors` in one call)
    ours 240 qwen3-30b-a3b-lora-s4096-b8-cap24 roundpipe-engine --warm 2 --iters 4 --no-buffer-reuse ;;
  look-ahead)  # [Note: shared frozen weights]: Llama-3.1-8B LoRA b8 under the cap, traced; every trace of the call's
    # look-ahead decisions printed at its end (scripts/device/look_ahead_report.py)
    ours 200 llama3.1-8b-lora-s4096-b8-cap24 roundpipe-engine --warm 2 --iters 3 --trace-dir "$OUT/traces" ;;
  buffer-reuse-4b)  # the dense half: Qwen3-4B full fine-tune b8 under the cap, reused (the default) and not
    ours 130 qwen3-4b-full-s4096-b8-cap24 roundpipe-engine --warm 2 --iters 3
    ours 130 qwen3-4b-full-s4096-b8-cap24 roundpipe-engine --warm 2 --iters 3 --no-buffer-reuse ;;
  placement-cap24)  # under the 24 GiB cap: Qwen3-4B full fine-tune, Llama-3.1-8B LoRA; auto runs first of each
    w=qwen3-4b-full-s4096-b8-cap24
    warm_up 75 $w roundpipe-engine --warm 1 --iters 1 --roundpipe optimizer_placement=auto
    ours 100 $w roundpipe-engine --warm 2 --iters 4 --roundpipe optimizer_placement=auto
    ours 100 $w roundpipe-engine --warm 2 --iters 4 --roundpipe optimizer_placement=host
    w=llama3.1-8b-lora-s4096-b8-cap24
    ours 130 $w roundpipe-engine --warm 2 --iters 3 --roundpipe optimizer_placement=auto
    ours 130 $w roundpipe-engine --warm 2 --iters 3 --roundpipe optimizer_placement=host ;;
  esac
}

run_anchors() {
  case $1 in
  qwen3-1.7b)
    in_gpu_liger 60 --model qwen3-1.7b --mode bf16 --seqs 4096 --gb 8 --mbs 8 --section qwen3-1.7b-liger
    reference 80 --model qwen3-1.7b --seqs 4096 --gb 8 --nms 4 --section qwen3-1.7b-reference ;;
  cap24)  # in-GPU training of the 4B does not fit 24 GiB: its OOM record is the result
    in_gpu_liger 60 --model qwen3-4b --mode bf16 --seqs 4096 --gb 8 --mbs 8,4,2,1 --cap 24 --section cap24-liger
    reference 120 --model qwen3-4b --seqs 4096 --gb 8 --nms 4 --iters 4 --cap 24 --section cap24-reference ;;
  lora-8b)
    in_gpu_liger 150 --model llama3.1-8b --mode lora --bf16-adapters --seqs 4096 --gb 8 --mbs 8,4 --iters 3 \
      --section lora-8b-liger
    reference 150 --model llama3.1-8b --lora --seqs 4096 --gb 8 --nms 4 --iters 3 --section lora-8b-reference ;;
  lora-8b-cap24)  # in-GPU LoRA of the 8B (16 GB of bf16 weights) hardly fits 24 GiB: its record is the result
    in_gpu_liger 100 --model llama3.1-8b --mode lora --bf16-adapters --seqs 4096 --gb 8 --mbs 2,1 --iters 3 --cap 24 \
      --section lora-8b-cap24-liger
    reference 150 --model llama3.1-8b --lora --seqs 4096 --gb 8 --nms 4 --iters 3 --cap 24 \
      --section lora-8b-cap24-reference ;;
  trainer-1.7b)  # the in-GPU anchor on the Trainer run's settings and step counts
    in_gpu_liger 60 --model qwen3-1.7b --mode bf16 --seqs 4096 --gb 8 --mbs 8 --warm 2 --iters 8 \
      --section trainer-1.7b-liger ;;
  placement)  # the in-GPU anchor on the same settings and step counts (the reference is in qwen3-1.7b's anchors)
    in_gpu_liger 60 --model qwen3-1.7b --mode bf16 --seqs 4096 --gb 8 --mbs 8 --warm 2 --iters 8 \
      --section placement-liger ;;
  long)  # sweeps stop at the first failure; ratios compare the longest sequence both ran
    in_gpu_liger 120 --model qwen3-1.7b --mode bf16 --seqs 16384,32768,65536 --gb 1 --mbs 1 --cap 24 \
      --section long-liger
    reference 150 --model qwen3-1.7b --seqs 65536,131072 --gb 1 --nms 1 --iters 2 --cap 24 --section long-reference ;;
  moe-cap24)  # the reference RoundPipe on the same model and steps, in its own process (it builds with the cap lifted)
    reference 240 --model qwen3-30b-a3b --lora --cap 24 --seqs 4096 --gb 8 --nms 4 --warm 2 --iters 4 \
      --section moe-cap24-reference ;;
  gpt-oss-cap24)
    reference 240 --model gpt-oss-20b --lora --cap 24 --seqs 4096 --gb 8 --nms 4 --warm 2 --iters 3 \
      --section gpt-oss-cap24-reference ;;
  two-gpus)  # the reference on the same settings on both GPUs (it takes every visible GPU; its cap is GPU 0's, and
    # every GPU's free memory reads as the cap)
    reference 120 --model qwen3-4b --seqs 4096 --gb 8 --nms 4 --iters 4 --cap 24 --section two-gpus-reference ;;
  two-gpus-lora)
    reference 150 --model llama3.1-8b --lora --seqs 4096 --gb 8 --nms 4 --iters 3 --cap 24 \
      --section two-gpus-lora-reference ;;
  two-gpus-moe)
    reference 240 --model qwen3-30b-a3b --lora --cap 24 --seqs 4096 --gb 8 --nms 4 --warm 2 --iters 4 \
      --section two-gpus-moe-reference ;;
  dense-32b-cap24)
    reference 240 --model qwen3-32b --lora --cap 24 --seqs 4096 --gb 8 --nms 4 --warm 2 --iters 3 \
      --section dense-32b-cap24-reference ;;
  *)
    echo "anchors: none for $1" | tee -a "$LOG" ;;
  esac
}

for name in "${names[@]}"; do
  run_ours "$name"
  [ $anchors = 1 ] && run_anchors "$name"
done
[ -d "$OUT/traces" ] && find "$OUT/traces" -name '*.json' -exec gzip -f {} +
ls -la "$OUT"
python3 benchmarks/call_summary.py "$OUT/ours.jsonl" "$OUT/results.jsonl" "$OUT"/convergence_*.jsonl 2>&1 \
  | tee -a "$LOG"
