"""GPU memory at every call boundary of an engine run, with what the measured plan predicted for its stages.

For finding where a capped run's memory goes when a plan that fits one call does not fit the next: each
`forward_backward` call is synchronized, and the record holds the memory allocated before it, its peak, what it
left, and after the re-plan the planned partition with its stage bytes and the limits it set (saved inputs kept on
the device, look-ahead prefetch). Accumulation N runs N calls of rows/N a step, as `runners/engine.py` does.

    python benchmarks/call_memory.py --workload qwen3-4b-full-s4096-b8-cap24 --call-rows 8 --accumulation 1,2 \
        --steps 2 --out DIR/call_memory.jsonl

Each accumulation count runs in its own process (an engine closed after an out-of-memory error still held its
device state in the one-process version). Synchronizing every call slows the run: take speeds from `run.py`, not
from here.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from accelerate_roundpipe import RoundPipeConfig, wrap_model  # noqa: E402
from benchmarks.memory import is_oom, memory_cap  # noqa: E402
from benchmarks.models import build_model, make_batch  # noqa: E402
from benchmarks.runners.common import close_engine, fused_adamw  # noqa: E402
from benchmarks.workloads import WORKLOADS  # noqa: E402

GiB = 2**30


def _gib(value: float) -> float:
    return round(value / GiB, 3)


def plan_of(engine) -> dict | None:
    """The measured plan's partition, stage bytes and limits (None before the re-plan)."""
    plan = engine._plan  # a diagnostic reads the engine's planning state by name
    chosen = plan.transfer_plan
    if chosen is None:
        return None
    planned = chosen.planned
    return {"partition": str(planned.partition), "num_microbatches": chosen.num_microbatches,
            "forward_stage_gib": [_gib(b) for b in planned.forward_stage_bytes],
            "backward_stage_gib": [_gib(b) for b in planned.backward_stage_bytes],
            "peak_working_gib": _gib(planned.peak_working_bytes), "budget_gib": _gib(plan.budget_bytes or 0),
            "keep_limit_gib": _gib(plan.keep_limit_bytes), "lookahead_limit_gib": _gib(plan.lookahead_limit_bytes)}


def run(workload: str, call_rows: int, accumulation: int, steps: int, extra: dict) -> dict:
    w = WORKLOADS[workload]
    seq = w.seqs[0]
    torch.manual_seed(0)
    model = build_model(w.arch, seq, w.lora)
    rows = call_rows * accumulation
    batch = make_batch(w.shape.vocab_size, rows, seq)
    calls = [{k: v[i * call_rows:(i + 1) * call_rows] for k, v in batch.items()} for i in range(accumulation)]
    config = RoundPipeConfig(devices=["cuda:0"], gpu_memory_budget=w.cap_gib, **extra)
    record = {"workload": workload, "rows": rows, "accumulation": accumulation, "config": extra, "calls": []}
    engine = None
    try:
        engine = wrap_model(model, config)
        optimizer = engine.wrap_optimizer(fused_adamw([p for p in engine.parameters() if p.requires_grad], 1e-5))
        for step in range(steps):
            for index, call in enumerate(calls):
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                loss = engine.forward_backward(**call, grad_scale=1.0 / accumulation)
                engine.synchronize()
                record["calls"].append({"step": step, "call": index, "before_gib": _gib(before),
                                        "peak_gib": _gib(torch.cuda.max_memory_allocated()),
                                        "after_gib": _gib(torch.cuda.memory_allocated()), "loss": loss.item()})
                print(json.dumps(record["calls"][-1]), flush=True)
            torch.cuda.reset_peak_memory_stats()
            optimizer.step()
            optimizer.zero_grad()
            engine.synchronize()
            record["calls"].append({"step": step, "call": "step", "peak_gib": _gib(torch.cuda.max_memory_allocated()),
                                    "after_gib": _gib(torch.cuda.memory_allocated())})
            print(json.dumps(record["calls"][-1]), flush=True)
        record["status"] = "ok"
    except Exception as error:  # noqa: BLE001 - the record says how the run ended
        if not is_oom(error):
            raise
        record["status"] = "OOM"
        record["error"] = str(error)[:400]
        record["oom_allocated_gib"] = _gib(torch.cuda.memory_allocated())
    finally:
        if engine is not None:
            record["plan"] = plan_of(engine)
        close_engine(engine)
    return record


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", required=True, choices=sorted(WORKLOADS))
    parser.add_argument("--call-rows", type=int, required=True, help="rows a call")
    parser.add_argument("--accumulation", default="1", help="comma-separated call counts a step")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--roundpipe", nargs="*", default=[], help="KEY=VALUE RoundPipeConfig settings")
    parser.add_argument("--out", required=True)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    counts = [int(a) for a in args.accumulation.split(",")]
    if len(counts) > 1:  # each count in its own process: a closed engine's device memory is not this run's
        for count in counts:
            subprocess.run([sys.executable, __file__, "--workload", args.workload, "--call-rows", str(args.call_rows),
                            "--accumulation", str(count), "--steps", str(args.steps), "--out", args.out,
                            "--roundpipe", *args.roundpipe], check=True)
        return
    extra = dict(item.split("=", 1) for item in args.roundpipe)
    memory_cap(WORKLOADS[args.workload].cap_gib)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for accumulation in counts:
        record = run(args.workload, args.call_rows, accumulation, args.steps, extra)
        print("CALL_MEMORY", json.dumps({k: v for k, v in record.items() if k != "calls"}), flush=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
