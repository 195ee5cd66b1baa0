#!/usr/bin/env bash
# Two source trees in turns on the 168M convergence preset, on the device: a throw-away warm-up, the plain Trainer,
# then RoundPipeTrainer at its defaults from tree A and tree B alternately, ROUNDS times each, each run in a process of
# its own. The spread between runs of one call is of the size of the changes it judges (docs/benchmarks.md), so a
# change is measured against its parent in the same call, in turns.
#
#   rm -rf .devrun && mkdir -p .devrun/a .devrun/b
#   git archive <parent> | tar -x -C .devrun/a && git archive HEAD | tar -x -C .devrun/b && cp -r .whl .devrun/
#   cp scripts/device/trees_in_turns.sh .devrun/   # then, with the device tool (carry [".devrun"]):
#   A_NAME=<parent> B_NAME=<head> bash .devrun/trees_in_turns.sh
#
# Records: $OUT/convergence_*.jsonl (the system field names the tree), the whole output in $OUT/ab.log, one line per
# run on screen; runs that would pass TOTAL_S (default 540) from the start are skipped.
set -u
cd "$(dirname "$0")"
: "${OUT:?set OUT to the folder the results go to (the device sets it)}"
A_NAME=${A_NAME:-a} B_NAME=${B_NAME:-b} ROUNDS=${ROUNDS:-2} TOTAL_S=${TOTAL_S:-540}
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
fi
export NCCL_NVLS_ENABLE=0 PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1
mkdir -p "$OUT"
run() {
  local tree=$1 limit=$2 start=$SECONDS
  shift 2
  if [ $((SECONDS + limit)) -gt "$TOTAL_S" ]; then echo "== skipped $tree $*"; return; fi
  (cd "$tree" && PYTHONPATH=/tmp/site:$PWD BENCH_COMMIT=$tree timeout "$limit" python3 benchmarks/convergence.py \
     --preset gpu --regimes scratch "$@") >>"$OUT/ab.log" 2>&1
  echo "== [$start s] $tree $* rc=$? took $((SECONDS - start)) s"
}
run b 80 --systems hf --steps 20 --eval-every 1000 --variant warm-up:optimizer_placement=auto --out "$OUT/warmup"
run b 90 --systems hf --out "$OUT"
for _ in $(seq "$ROUNDS"); do
  run b 100 --systems "" --variant "$B_NAME:" --out "$OUT"
  run a 100 --systems "" --variant "$A_NAME:" --out "$OUT"
done
python3 - "$OUT" <<'PY'
import glob, json, sys
for path in sorted(glob.glob(sys.argv[1] + "/convergence_*.jsonl")):
    for line in open(path):
        r = json.loads(line)
        print(r["system"], "train", r["train_runtime_s"], "median", r["median_step_ms"], "prepare", r["prepare_s"],
              "first", r["first_step_s"], "evals", r["eval_runtime_s"], "final", r["final_eval_runtime_s"],
              "held-out", round(r["final_eval_loss"], 4))
PY
