"""How fast gloo moves host tensors between processes: reduce-scatter and all-gather of one decoder layer's flat
buffer, issued as one collective or cut into chunks issued at once on several process groups (one thread each).

    torchrun --nproc-per-node 2 benchmarks/gloo_bandwidth.py [--mib 192] [--streams 1,2,4,8] [--out gloo.jsonl]

Prints, per variant, the seconds per collective and the algorithm bandwidth (buffer bytes / seconds), the number
the data-parallel engine's step time depends on ([Note: data parallel]).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.records import emit  # noqa: E402


def run_parallel(jobs: list) -> None:
    """Run each job on its own thread and wait for all (gloo blocks the issuing thread until its collective ends)."""
    threads = [threading.Thread(target=job) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def reduce_scatter_jobs(flat: torch.Tensor, out: torch.Tensor, groups: list, world: int) -> list:
    """Chunk c of every rank's range, reduce-scattered on group c (list form: each piece a contiguous view)."""
    per_rank = flat.numel() // world
    step = per_rank // len(groups)
    jobs = []
    for c, group in enumerate(groups):
        pieces = [flat[r * per_rank + c * step: r * per_rank + (c + 1) * step] for r in range(world)]
        target = out[c * step:(c + 1) * step]
        jobs.append(lambda pieces=pieces, target=target, group=group: dist.reduce_scatter(target, pieces, group=group))
    return jobs


def all_gather_jobs(flat: torch.Tensor, rank: int, groups: list, world: int) -> list:
    per_rank = flat.numel() // world
    step = per_rank // len(groups)
    jobs = []
    for c, group in enumerate(groups):
        pieces = [flat[r * per_rank + c * step: r * per_rank + (c + 1) * step] for r in range(world)]
        mine = pieces[rank].clone()
        jobs.append(lambda pieces=pieces, mine=mine, group=group: dist.all_gather(pieces, mine, group=group))
    return jobs


def timed(make_jobs, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats + 1):  # the first is a warm-up
        jobs = make_jobs()
        dist.barrier()
        start = time.perf_counter()
        run_parallel(jobs)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=float, default=192.0, help="buffer size (a Qwen3-1.7B layer in float32)")
    parser.add_argument("--streams", default="1,2,4,8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    streams = [int(s) for s in args.streams.split(",")]
    all_groups = [dist.new_group(backend="gloo") for _ in range(max(streams))]
    numel = int(args.mib * 2**20 / 4) // (world * max(streams) * 16) * (world * max(streams) * 16)
    flat = torch.randn(numel)
    out = torch.empty(numel // world)
    for count in streams:
        groups = all_groups[:count]
        rs = timed(lambda groups=groups: reduce_scatter_jobs(flat, out, groups, world), args.repeats)
        ag = timed(lambda groups=groups: all_gather_jobs(flat, rank, groups, world), args.repeats)
        record = {"world_size": world, "mib": numel * 4 / 2**20, "streams": count, "reduce_scatter_s": rs,
                  "all_gather_s": ag, "reduce_scatter_gb_s": numel * 4 / rs / 1e9,
                  "all_gather_gb_s": numel * 4 / ag / 1e9, "threads": torch.get_num_threads(),
                  "commit": os.environ.get("BENCH_COMMIT", "unknown")}
        if rank == 0:
            emit(record, args.out, digits=4)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
