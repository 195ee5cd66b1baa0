"""Data parallelism on one machine: N processes, each its own RoundPipe engine, gloo for the host collectives.

Run under torchrun (every rank builds the same random-init model from the workload's config; each trains on its
share of the global batch):

    torchrun --nproc-per-node 2 benchmarks/data_parallel_smoke.py --workload qwen3-1.7b-full-s4096-b8 \
        --budget 60 --trace-dir traces --out dp.jsonl

Prints, per rank, tokens per second of the global batch, and from the rank's trace the time its optimizer thread
spent in collectives per step and how much of that overlapped the device's compute (a collective running while the
GPU computes is hidden; one after the backward is not). On one GPU the ranks share it, so the speed says how the
pieces fit together, not how N machines scale (docs/multi-node.md models that).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from accelerate_roundpipe import RoundPipeConfig, wrap_model  # noqa: E402
from benchmarks.models import build_model, make_batch  # noqa: E402
from benchmarks.records import emit  # noqa: E402
from benchmarks.workloads import WORKLOADS  # noqa: E402

COLLECTIVE_WORDS = ("reduce", "gather", "collective", "all-reduce", "broadcast")


def collective_time(trace_path: str, last_s: float) -> dict[str, float]:
    """Seconds of collective spans in the trace's last `last_s` seconds, and the part that overlapped GPU compute."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M"}
    spans = [e for e in events if e.get("ph") == "X"]
    end = max(e["ts"] + e["dur"] for e in spans)
    window = [e for e in spans if e["ts"] >= end - last_s * 1e6]
    compute = sorted((e["ts"], e["ts"] + e["dur"]) for e in window if "compute" in names.get(e["tid"], ""))
    comms = [e for e in window if any(w in e["name"].lower() or w in names.get(e["tid"], "").lower()
                                      for w in COLLECTIVE_WORDS)]
    total = hidden = 0.0
    for e in comms:
        start, stop = e["ts"], e["ts"] + e["dur"]
        total += stop - start
        hidden += sum(max(0.0, min(stop, b) - max(start, a)) for a, b in compute)
    return {"collective_s": total / 1e6, "collective_hidden_s": hidden / 1e6, "collective_spans": len(comms)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="qwen3-1.7b-full-s4096-b8", choices=sorted(WORKLOADS))
    parser.add_argument("--warm", type=int, default=2)
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument("--budget", type=float, default=None, help="gpu_memory_budget per rank, GiB")
    parser.add_argument("--trace-dir", default=None)
    parser.add_argument("--out", default=None, help="JSON lines, one record per rank")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    w = WORKLOADS[args.workload]
    if w.global_batch % world:
        raise SystemExit(f"global batch {w.global_batch} does not split over {world} ranks")
    rows, seq = w.global_batch // world, w.seqs[0]
    torch.manual_seed(0)  # the same initial weights on every rank
    model = build_model(w.arch, seq, w.lora)
    extra = {"gpu_memory_budget": args.budget} if args.budget else {}
    trace = None
    if args.trace_dir:
        Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
        trace = str(Path(args.trace_dir) / f"dp-rank{rank}-of-{world}.json")
        extra["trace_path"] = trace
    devices = ["cuda:0"] if torch.cuda.is_available() else ["cpu"]
    engine = wrap_model(model, RoundPipeConfig(devices=devices, **extra))
    optimizer = engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-5))
    batch = make_batch(model.config.vocab_size, rows, seq, seed=1 + rank)  # each rank its own share
    step_s, losses = [], []
    for _ in range(args.warm + args.iters):
        engine.synchronize()
        dist.barrier()
        start = time.perf_counter()
        loss = engine.forward_backward(**batch)
        optimizer.step()
        optimizer.zero_grad()
        engine.synchronize()
        step_s.append(time.perf_counter() - start)
        losses.append(float(loss))
    timed = step_s[args.warm:]
    record = {"workload": args.workload, "rank": rank, "world_size": world, "rows_per_rank": rows, "seq": seq,
              "tokens_per_s": w.global_batch * seq * len(timed) / sum(timed), "step_s": step_s, "losses": losses,
              "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
              "commit": os.environ.get("BENCH_COMMIT", "unknown")}
    if trace:
        engine.save_trace(trace)
    engine.close()
    if trace:
        per_step = collective_time(trace, sum(timed))
        record.update({k: v / len(timed) if k.endswith("_s") else v for k, v in per_step.items()})
    emit(record, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
