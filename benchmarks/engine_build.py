"""How long wrapping a model takes: `wrap_model` and `wrap_optimizer` on the 168M convergence preset (issue 31 item
10's start-up), with the bucket flats filled once ([Note: bucket flats filled once]) beside the zeroed flats of
before, in turns in one process, so the baseline is measured in the same run.

    python benchmarks/engine_build.py --runs 5 --out build.jsonl

Each run builds the preset's model (bf16, from its config) outside the clock, then times the wrap on the devices
given (default: CUDA when present, else one CPU worker). The record has every run's seconds and the medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from accelerate_roundpipe import RoundPipeConfig, wrap_model  # noqa: E402
from accelerate_roundpipe.runtime.state import host_store  # noqa: E402
from benchmarks import convergence  # noqa: E402
from benchmarks.commit import git_commit  # noqa: E402

VARIANTS = {
    "filled-once": host_store.uninitialized,  # the default
    "zeroed-flats": lambda numel, dtype: torch.zeros(numel, dtype=dtype),  # as before: zeroed, then copied into
}


def time_wrap(model_config, devices: list[str], allocate) -> float:
    """Seconds of `wrap_model` + `wrap_optimizer(AdamW)` with bucket flats made by `allocate`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(model_config, dtype=torch.bfloat16)
    original = host_store.uninitialized
    host_store.uninitialized = allocate
    try:
        start = time.perf_counter()
        engine = wrap_model(model, RoundPipeConfig(devices=devices, summary=False))
        engine.wrap_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-4))
        seconds = time.perf_counter() - start
    finally:
        host_store.uninitialized = original
    engine.close()
    return seconds


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(convergence.PRESETS), default="gpu")
    parser.add_argument("--runs", type=int, default=5, help="runs of each variant, in turns")
    parser.add_argument("--devices", default=None, help="RoundPipe devices (default: cuda:0, else cpu)")
    parser.add_argument("--out", default=None, help="JSONL file the record is appended to")
    args = parser.parse_args(argv)
    devices = args.devices.split(",") if args.devices else (["cuda:0"] if torch.cuda.is_available() else ["cpu"])
    model_config = convergence.qwen3_config(convergence.resolve(convergence.parse_args(["--preset", args.preset])))
    seconds: dict[str, list[float]] = {name: [] for name in VARIANTS}
    time_wrap(model_config, devices, VARIANTS["filled-once"])  # a throw-away first run: imports, allocator warm-up
    for _ in range(args.runs):
        for name, allocate in VARIANTS.items():
            seconds[name].append(round(time_wrap(model_config, devices, allocate), 4))
    record = {"benchmark": "engine_build", "commit": git_commit(), "preset": args.preset, "devices": devices,
              "threads": torch.get_num_threads(), "seconds": seconds,
              "median_s": {name: statistics.median(values) for name, values in seconds.items()}}
    for name, values in seconds.items():
        print(f"{name:13s} median {record['median_s'][name]:.3f} s  runs {values}", flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(record) + "\n")
    return record


if __name__ == "__main__":
    main()
