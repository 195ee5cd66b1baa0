"""Run one benchmark workload on one of our three ways in and append its records (one per micro-batch count and
sequence length) to a JSONL file, in the format `benchmarks/collect.py` reads:

    python benchmarks/run.py --workload qwen3-1.7b-full-s4096-b8 --system roundpipe-trainer --nms auto --out ours.jsonl

Run one system per process (the host peak is per process). Every record states how the optimizer stepped
(`settings.optimizer_step`: "async", one step late, or "sync"; `ROUNDPIPE_ASYNC_OPTIMIZER` chooses), the clipping
(`settings.max_grad_norm`, 0: none), how often the loss reached the host (`settings.logging_steps`) and where the
optimizer state lived (`settings.optimizer_placement`, as the engine placed it); a variant of a way in is named by
its system: `-sync-optimizer`, `-clip<max_grad_norm>`, `-placement-<placement>`.

Any other `RoundPipeConfig` field is given as `--roundpipe FIELD=VALUE` (repeatable; the value as its
`ROUNDPIPE_<FIELD>` variable takes it), e.g. `--roundpipe optimizer_placement=host`.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import gc
import importlib
import importlib.metadata
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from accelerate_roundpipe import RoundPipeConfig  # noqa: E402
from benchmarks.commit import git_commit  # noqa: E402
from benchmarks.flops import PEAK_TFLOPS, mfu, workload_flops_per_token  # noqa: E402
from benchmarks.host_ballast import host_ballast  # noqa: E402
from benchmarks.host_buffers import torch_pinned_cache  # noqa: E402
from benchmarks.memory import host_peak_gib, is_oom, memory_cap  # noqa: E402
from benchmarks.models import build_model, make_batch  # noqa: E402
from benchmarks.records import emit  # noqa: E402
from benchmarks.runners import (
    RUNNERS,  # noqa: E402
    common,  # noqa: E402
)
from benchmarks.runners.common import config_values  # noqa: E402
from benchmarks.workloads import WORKLOADS, is_sweep, lora_targets  # noqa: E402

LOOP_LOGGING_STEPS = 1  # the engine and Accelerate loops read the loss every step (see runners/__init__.py)
# RoundPipeConfig fields a flag of their own sets; `--roundpipe` takes every other field.
FLAG_FIELDS = {"devices": "--devices", "num_microbatches": "--nms", "kernels": "--kernels", "recompute": "--recompute",
               "gpu_memory_budget": "--budget", "mlp_chunk_tokens": "--mlp-chunk-tokens", "trace_path": "--trace-dir"}


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def optimizer_placement(config: RoundPipeConfig, path: dict | None) -> str:
    """Where the optimizer state lived: what the engine reported it placed (`common.placed_as`: "host" when every
    bucket stayed on the host, e.g. "auto" with CPU workers or under data parallelism), else, for a run that failed
    before its engine placed anything, the setting it asked for."""
    placed = (path or {}).get("optimizer_placement")
    return placed["placed"] if placed else config.resolved_optimizer_placement


def system_name(system: str, async_optimizer: bool, max_grad_norm: float, placement: str = "host") -> str:
    """The way in, and how it stepped: the plain name is the lagged (async) step without clipping, its optimizer
    state on the host, as every record before the exact step became the default was; `-sync-optimizer` is the exact
    step, `-clip<n>` clipping, `-placement-<p>` optimizer state placed otherwise than all on the host."""
    name = system if async_optimizer else f"{system}-sync-optimizer"
    name = f"{name}-clip{max_grad_norm:g}" if max_grad_norm else name
    return name if placement == "host" else f"{name}-placement-{placement}"


def model_settings(model: torch.nn.Module, lora_arch: str | None) -> dict:
    """What the built model is: its parameter counts, attention and experts implementations and, under LoRA, the
    targets PEFT was given (on a mixture of experts they reach the experts' fused parameters)."""
    config = model.config
    out = {"params": sum(p.numel() for p in model.parameters()),
           "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
           "attn_implementation": config._attn_implementation,
           "experts_implementation": getattr(config, "_experts_implementation", None)}
    if lora_arch is not None:
        out["lora_targets"] = lora_targets(lora_arch)
    return out


def disk_probe(config: RoundPipeConfig, path: dict | None) -> dict:
    """The disk's own sequential bandwidth under `offload_dir`, as the engine measured it at start when it had a
    disk tier, else measured here (a run all on the host, for comparison in the same call)."""
    from accelerate_roundpipe.runtime.disk import probe_bandwidth

    placed = ((path or {}).get("optimizer_placement") or {}).get("disk")
    if placed and "disk_read_gbps" in placed:
        return {**{k: v for k, v in placed.items() if k.startswith("disk_")}, "measured_by": "the engine's start"}
    folder = config.resolved_offload_dir
    os.makedirs(folder, exist_ok=True)
    return {**common.disk_bandwidth_of(probe_bandwidth(folder)), "measured_by": "benchmarks/run.py"}


def run_one(workload: str, system: str, seq: int, config: RoundPipeConfig, warm: int, iters: int, lr: float,
            peak_tflops: float, logging_steps: int = 10, max_grad_norm: float = 0.0,
            with_disk_probe: bool = False) -> dict:
    w = WORKLOADS[workload]
    trainer = system == "roundpipe-trainer"
    training = {"optimizer_step": "async" if config.resolved_async_optimizer else "sync",
                "max_grad_norm": max_grad_norm, "logging_steps": logging_steps if trainer else LOOP_LOGGING_STEPS}
    # the system's name says where the optimizer state lived, which the engine decides: set once the run is over
    record = {"workload": workload, "system": None, "seq": seq, "global_batch": w.global_batch,
              "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "commit": git_commit(),
              "max_seq": seq if is_sweep(workload) else None}
    settings = {"seq": seq, "global_batch": w.global_batch, "mem_cap_gib": w.cap_gib, "lora": w.lora,
                "num_microbatches": config.num_microbatches, "accumulation": w.accumulation, "warm": warm,
                "iters": iters, "lr": lr, **training,
                # With the measured plan the step after the first is the re-planned partition's first pass, slower
                # than the rest (Qwen3-32B: 17.6 s against 12.6 s); with one warm-up step it is timed.
                "first_timed_step_is_first_planned_pass": config.resolved_plan == "measured" and warm < 2,
                "tokens_per_s_basis": "mean of the timed steps, synchronized at both ends",
                "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "config": config_values(config),
                # our engine's fused kernels are Liger's when it is installed (kernels="auto")
                "liger_kernel": _version("liger-kernel")}
    flops_per_token = workload_flops_per_token(w.shape, seq, w.lora)
    if settings["first_timed_step_is_first_planned_pass"]:
        print(f"[bench] {workload} {system}: --warm {warm} with the measured plan: the first timed step is the "
              f"re-planned partition's first pass, slower than the steps after it (use --warm 2 for a steady rate)",
              file=sys.stderr, flush=True)
    try:
        import transformers

        settings["transformers"] = transformers.__version__
        torch.manual_seed(0)  # the same initial weights in every run: variants' losses compare step by step
        started = time.perf_counter()
        model = build_model(w.arch, seq, w.lora)
        # the build's own time and host peak (the run's peaks are measured from the wrap on)
        settings.update(model_settings(model, w.arch if w.lora else None),
                        build_s=round(time.perf_counter() - started, 1), build_host_peak_gib=host_peak_gib())
        batch = make_batch(w.shape.vocab_size, w.global_batch, seq)
        extra = {"logging_steps": logging_steps, "max_grad_norm": max_grad_norm} if trainer else {}
        if w.accumulation > 1:  # only the engine runner accumulates (checked in `main` before anything is built)
            extra["accumulation"] = w.accumulation
        result = RUNNERS[system](model, config, batch, warm, iters, lr, **extra)
    except Exception as error:  # noqa: BLE001 -- a failed configuration is a result too
        status = "OOM" if is_oom(error) else "ERROR"
        print(f"[bench] {workload} {system} seq={seq}: {status} {error!r}", file=sys.stderr, flush=True)
        placement = settings["optimizer_placement"] = optimizer_placement(config, None)
        record["system"] = system_name(system, config.resolved_async_optimizer, max_grad_norm, placement)
        return {**record, "tokens_per_s": None, "mfu": None, "gpu_peak_gib": None, "host_peak_gib": None,
                "status": status, "error": repr(error)[:600], "settings": settings}
    placement = optimizer_placement(config, result["path"])  # the engine's, after the optimizer was wrapped
    if with_disk_probe:
        settings["disk_bandwidth"] = disk_probe(config, result["path"])
    settings.update(optimizer_placement=placement, num_microbatches=result["num_microbatches"], path=result["path"],
                    step_s=result["step_s"], torch_pinned_cache=torch_pinned_cache())
    record["system"] = system_name(system, config.resolved_async_optimizer, max_grad_norm, placement)
    return {**record, "tokens_per_s": result["tokens_per_s"], "iter_s": result["iter_s"],
            # Steady state as the reference's and the in-GPU anchors' scripts report it: the median timed step.
            "tokens_per_s_median_step": median_step_tokens_per_s(result["step_s"][warm:], w.global_batch * seq),
            "mfu": mfu(flops_per_token, result["tokens_per_s"], peak_tflops), "gpu_peak_gib": result["gpu_peak_gib"],
            "host_peak_gib": result["host_peak_gib"], "status": "ok",
            "losses": [round(v, 5) for v in result["losses"]], "flops_per_token": flops_per_token,
            "settings": settings}


MIN_STEPS_FOR_MEDIAN = 3


def median_step_tokens_per_s(timed_step_s: list[float], tokens_per_step: int) -> float | None:
    """Tokens a second over the median of the timed steps' unsynchronized wall times, or None with fewer than
    `MIN_STEPS_FOR_MEDIAN` of them: a step's wall time says when the caller got its result back, which in steady
    state is the step's pace, but one or two steps (the disk runs time one) return long before their work ends (the
    8B disk run: 1.29 s against 34.1 s synchronized), and a figure from them would be 26 times too high."""
    if len(timed_step_s) < MIN_STEPS_FOR_MEDIAN:
        return None
    return round(tokens_per_step / statistics.median(timed_step_s), 1)


@dataclasses.dataclass(frozen=True)
class VariantSwitch:
    """A `--flag` that runs a computation as it was before a change, by setting one module attribute, so that the
    two are measured beside each other; the record's `variant` and system name say which ran."""

    flag: str
    module: str
    attribute: str
    value: object
    help: str


VARIANT_SWITCHES = (
    VariantSwitch("peft-lora-adds", "accelerate_roundpipe.compat.peft_linear", "enabled", False,
                  "LoRA on linear layers computed PEFT's way (its product, scaled, then added: three passes over the "
                  "output) instead of inside one GEMM ([Note: LoRA added in the GEMM])"),
    VariantSwitch("peft-merged-experts", "accelerate_roundpipe.compat.peft_experts", "enabled", False,
                  "LoRA on MoE experts computed PEFT's way (the merged weight per call) instead of through its "
                  "factors ([Note: factored LoRA on experts])"),
    VariantSwitch("whole-bucket-uploads", "accelerate_roundpipe.runtime.devices.device", "PARAM_UPLOAD_CHUNK_BYTES",
                  1 << 62, "upload each parameter bucket in one copy, as before the chunked uploads "
                  "([Note: parameter uploads in chunks])"),
    VariantSwitch("no-buffer-reuse", "accelerate_roundpipe.runtime.execution.weight_buffers", "IDLE_TASKS", 0,
                  "every task's parameter buffers back to torch's caching allocator at its end, as before "
                  "[Note: weight buffers reused]"),
    VariantSwitch("keep-idle-buffers", "accelerate_roundpipe.runtime.execution.residency",
                  "GIVE_BACK_IDLE_AT_PREFETCH", False, "idle weight buffers kept until they age out, as before "
                  "[Note: idle buffers given back at the prefetch]"),
    VariantSwitch("limits-without-placed-state", "accelerate_roundpipe.runtime.execution.measured_plan",
                  "COUNT_PLACED_STATE", False, "the saved-input and look-ahead limits without the optimizer state "
                  "placed on the device, as before [Note: limits in allocated bytes]"),
    VariantSwitch("one-swap-file", "accelerate_roundpipe.runtime.state.disk_tier", "MAX_PIECES", 1,
                  "each disk bucket's swap file in one piece, as before [Note: swap files in pieces]"),
    VariantSwitch("four-io-threads", "accelerate_roundpipe.runtime.disk.io_threads", "IO_THREADS", 4,
                  "the disk tier's 4 I/O threads of before [Note: swap files in pieces]"),
    VariantSwitch("pooled-saved-inputs", "accelerate_roundpipe.runtime.state.saved_input_buffers", "POOLED",
                  True, "saved layer inputs in the store's pooled page-locked blocks (eighth-of-an-octave sizes) "
                  "instead of torch's caching host allocator (power-of-two blocks) "
                  "[Note: saved inputs in pooled blocks]"),
    # every layer input fits the host's share: one-layer stages
    VariantSwitch("one-layer-first-pass", "accelerate_roundpipe.runtime.execution.first_pass", "SAVED_HOST_SHARE",
                  math.inf, "the unplanned first pass with one-layer backward stages whatever its saved inputs take "
                  "of the host, as before [Note: first-pass backward stages]"),
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", required=True, choices=sorted(WORKLOADS))
    parser.add_argument("--system", required=True, choices=sorted(RUNNERS))
    parser.add_argument("--nms", default="4", help="micro-batch counts to run (comma-separated; 'auto': the "
                        "engine's choice), one record each")
    parser.add_argument("--seqs", default=None, help="override the workload's sequence lengths (comma-separated)")
    parser.add_argument("--devices", default=None, help="RoundPipe devices (default: cuda:0, else cpu)")
    parser.add_argument("--warm", type=int, default=2)
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS, help="per-GPU dense bf16 peak for the MFU")
    parser.add_argument("--kernels", default=None, choices=["auto", "liger", "none"])
    parser.add_argument("--disk-probe", action="store_true", help="record the disk's sequential bandwidth under "
                        "offload_dir in the record's settings (the engine's start probe when it had a disk tier)")
    for switch in VARIANT_SWITCHES:
        parser.add_argument(f"--{switch.flag}", action="store_true", help=f"{switch.help}, to measure the two beside "
                            f"each other")
    parser.add_argument("--host-available-gib", type=float, default=None, help="emulate a smaller host: a child "
                        "process holds memory so that about this many GiB stay available (benchmarks/host_ballast.py; "
                        "the disk tier's runs, whose swap files the page cache would otherwise hold)")
    parser.add_argument("--trace-dir", default=None, help="write a timeline trace per run here (then "
                        "`python -m accelerate_roundpipe.telemetry.report TRACE` gives the measured bubble)")
    parser.add_argument("--budget", type=float, default=None, help="gpu_memory_budget in GiB (default: the cap)")
    parser.add_argument("--mlp-chunk-tokens", type=int, default=None, help="tile dense MLPs above this many tokens")
    parser.add_argument("--recompute", default=None, choices=["stage", "layer"])
    parser.add_argument("--torch-threads", type=int, default=None)
    parser.add_argument("--logging-steps", type=int, default=10, help="the Trainer's logging_steps")
    parser.add_argument("--max-grad-norm", type=float, default=0.0, help="the Trainer's max_grad_norm (0: no "
                        "clipping; the loops never clip)")
    parser.add_argument("--roundpipe", action="append", default=[], metavar="FIELD=VALUE",
                        help="any other RoundPipeConfig field, as its ROUNDPIPE_<FIELD> variable takes it "
                        "(repeatable), e.g. optimizer_placement=host")
    parser.add_argument("--out", required=True, help="JSONL file the records are appended to")
    args = parser.parse_args(argv)
    if args.max_grad_norm and args.system != "roundpipe-trainer":
        parser.error("--max-grad-norm is the Trainer's; the engine and Accelerate loops do not clip")
    try:  # checked before any model is built: a typo must not measure the default
        args.roundpipe = roundpipe_fields(args.roundpipe)
    except ValueError as error:
        parser.error(str(error))
    return args


def roundpipe_fields(items: list[str]) -> dict[str, str]:
    """`FIELD=VALUE` items as RoundPipeConfig keyword arguments (values as text: the config parses them as it parses
    its variables). An unknown field is an error naming the close matches; a field with a flag of its own is an
    error naming the flag."""
    fields = [f.name for f in dataclasses.fields(RoundPipeConfig)]
    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ValueError(f"--roundpipe {item!r}: expected FIELD=VALUE")
        if key in FLAG_FIELDS:
            raise ValueError(f"--roundpipe {item!r}: give {key} with {FLAG_FIELDS[key]}")
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ValueError(f"--roundpipe {item!r}: RoundPipeConfig has no field {key}{hint}")
        out[key] = value.strip()
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    w = WORKLOADS[args.workload]
    if w.accumulation > 1 and args.system != "roundpipe-engine":
        raise SystemExit(f"workload {args.workload} accumulates {w.accumulation} calls a step; only --system "
                         f"roundpipe-engine runs accumulation.")
    seqs = [int(s) for s in args.seqs.split(",")] if args.seqs else list(w.seqs)
    devices = args.devices.split(",") if args.devices else (["cuda:0"] if torch.cuda.is_available() else ["cpu"])
    memory_cap(w.cap_gib)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for nms in (None if v == "auto" else int(v) for v in args.nms.split(",")):
        for seq in seqs:
            extra = {"gpu_memory_budget": w.cap_gib} if w.cap_gib and any(d.startswith("cuda") for d in devices) \
                else {}
            if args.budget:
                extra["gpu_memory_budget"] = args.budget
            if args.mlp_chunk_tokens:
                extra["mlp_chunk_tokens"] = args.mlp_chunk_tokens
            if args.trace_dir:
                extra["trace_path"] = str(Path(args.trace_dir) / f"{args.workload}-{args.system}-s{seq}-n{nms}.json")
            config = RoundPipeConfig(devices=devices, num_microbatches=nms and min(nms, w.global_batch),
                                     kernels=args.kernels, recompute=args.recompute, **extra, **args.roundpipe)
            variant = [switch for switch in VARIANT_SWITCHES if getattr(args, switch.flag.replace("-", "_"))]
            for switch in variant:
                setattr(importlib.import_module(switch.module), switch.attribute, switch.value)
            with host_ballast(args.host_available_gib) as ballast:
                record = run_one(args.workload, args.system, seq, config, args.warm, args.iters, args.lr,
                                 args.peak_tflops if torch.cuda.is_available() else 0.0, args.logging_steps,
                                 args.max_grad_norm, args.disk_probe)
            if args.host_available_gib is not None:  # the host emulated: what the run saw, and what was held
                record["settings"].update(host_available_gib=args.host_available_gib,
                                          host_ballast_gib=round(ballast / 2**30, 2))
            if variant:  # the record says which computation it measured
                record["variant"] = [switch.flag for switch in variant]
                record["system"] = "-".join([record["system"] or args.system, *record["variant"]])
            emit(record, args.out)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            if record["status"] != "ok" and is_sweep(args.workload):
                break  # sequence sweep: stop at the first failure


if __name__ == "__main__":
    main()
