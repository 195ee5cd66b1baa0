"""Where a training step's time goes, read from the engine's own timeline trace (`trace_path` / `ROUNDPIPE_TRACE`,
`--trace-dir` of `benchmarks/run.py`), set against the bounds a step cannot beat: the GPU's compute, PCIe and the
host's optimizer step (issue 32 item 4: "dense under the cap").

    python3 benchmarks/step_bounds.py TRACE.json[.gz] [--steps 3 | --seconds 5] \
        [--workload qwen3-4b-full-s4096-b8-cap24 [--tokens-per-step N] | --flops-per-step F] [--peak-tflops 790] \
        [--pcie-gbps 50] [--pcie-bytes-per-step B] [--host-step-s S] [--json]

Per track of the window (the last N steps, or seconds): its busy seconds per step (the union of its spans, so
overlapping spans of one track count once), its share of the window, and the bytes its copies moved (the engine names
each copy span by its size, `Device._traced`: "12.3 MiB"; disk spans by their byte range); then the compute track's
longest idle gaps with what every other track was doing in them, the bounds beside the measured numbers, and each
task with its time and its waits for weights.

Plain functions over the loaded JSON (`{"traceEvents": [...]}`), so each number can be tested on a hand-made trace
and re-read from a trace brought back from the device. Trace times are microseconds; ours are seconds.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository root on the path, as benchmarks/run.py does
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from accelerate_roundpipe.plan.schedule import Task  # noqa: E402
from accelerate_roundpipe.telemetry.report import TaskSpan, _starts_a_pass, last_seconds  # noqa: E402
from benchmarks.trace_summary import gaps, load, union_length  # noqa: E402

Span = tuple[float, float, str]  # start, end (seconds), name

DEFAULT_PEAK_TFLOPS = 790.0  # an achievable dense bf16 rate of one H200 (flops.PEAK_TFLOPS, 989, is the datasheet's)
DEFAULT_PCIE_GBPS = 50.0  # GB/s one way: about what page-locked copies reach on PCIe Gen5 x16
UPLOADS = ("parameter upload", "activation upload")  # host -> device copies: one direction of the link
DOWNLOADS = ("gradient download", "activation download")  # device -> host: the other direction
MIB = re.compile(r"^(\d+(?:\.\d+)?) MiB$")
BYTE_RANGE = re.compile(r"\[(\d+), (\d+)\)$")


def track_spans(trace: dict) -> dict[str, list[Span]]:
    """Each named track's complete spans, sorted by start, in seconds (tracks are named by `thread_name` metadata;
    an unnamed thread keeps its id, so nothing is dropped)."""
    events = trace.get("traceEvents", [])
    names = {(e.get("pid", 0), e["tid"]): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    tracks: dict[str, list[Span]] = {}
    for e in events:
        if e.get("ph") != "X":
            continue
        track = names.get((e.get("pid", 0), e["tid"]), str(e["tid"]))
        start = float(e["ts"]) / 1e6
        tracks.setdefault(track, []).append((start, start + float(e.get("dur", 0.0)) / 1e6, e.get("name", "")))
    return {track: sorted(spans) for track, spans in tracks.items()}


def compute_tracks(tracks: dict[str, list[Span]]) -> list[str]:
    """The tracks whose busy time is the devices' work: the GPU compute streams' (`<device> compute`) where the
    trace has them, else the workers' host spans (a CPU run without kernel timing), as `report.load_task_spans`."""
    for kind in (" compute", " host"):
        found = sorted(t for t in tracks if t.endswith(kind))
        if found:
            return found
    return []


def pass_starts(tracks: dict[str, list[Span]], compute: Sequence[str]) -> list[float]:
    """When each pass (one training step's forward and backward) began: the start of its first task, the one
    `report._starts_a_pass` names, on any device."""
    starts = []
    for track in compute:
        for start, _end, name in tracks[track]:
            try:
                task = Task.from_str(name)
            except ValueError:
                continue
            if _starts_a_pass(task):
                starts.append(start)
    return sorted(starts)


def window(tracks: dict[str, list[Span]], compute: Sequence[str], steps: int | None = None,
           seconds: float | None = None) -> tuple[float, float, int]:
    """(begin, end, steps) of the window measured: from the first task of the last `steps` passes (default: every
    pass but the first, the engine's profiling pass, when there are more), or of the tasks that start in the last
    `seconds` (`report.last_seconds`), to the trace's last span (the last step's optimizer work runs after its
    backward). The step count of a window in seconds is the passes that start in it."""
    end = max(s[1] for spans in tracks.values() for s in spans)
    starts = pass_starts(tracks, compute)
    if seconds is not None:
        tasks = [TaskSpan(t, None, s, e) for t in compute for s, e, _ in tracks[t]]
        begin = min(s.start for s in last_seconds(tasks, seconds))
        return begin, end, max(1, sum(1 for s in starts if s >= begin))
    if not starts:
        begin = min(s[0] for t in compute for s in tracks[t])
        return begin, end, 1
    if steps is None:
        steps = len(starts) - 1 if len(starts) > 1 else 1
    steps = max(1, min(steps, len(starts)))
    return starts[-steps], end, steps


def clipped(spans: Sequence[Span], begin: float, end: float) -> list[tuple[float, float]]:
    """The sorted (start, end) parts of `spans` inside [begin, end]."""
    return sorted((max(s, begin), min(e, end)) for s, e, _ in spans if e > begin and s < end)


def span_bytes(name: str) -> int:
    """The bytes a span's copy moved, from its name: a device copy's "<size> MiB" (`Device._traced`, one decimal),
    a disk transfer's "[start, stop)" byte range (`disk_tier`); 0 for any other span."""
    match = MIB.match(name)
    if match:
        return round(float(match.group(1)) * 2**20)
    match = BYTE_RANGE.search(name)
    return int(match.group(2)) - int(match.group(1)) if match else 0


def track_bytes(spans: Sequence[Span], begin: float, end: float) -> int:
    """The bytes of the spans that start in [begin, end) (a copy is counted whole, in the step it was issued)."""
    return sum(span_bytes(name) for s, _, name in spans if begin <= s < end)


def idle_gaps(tracks: dict[str, list[Span]], compute: str, begin: float, end: float, least: float,
              count: int) -> list[dict]:
    """The `count` longest holes (at least `least` seconds) of the `compute` track inside the window, longest
    first, each with every other track's busy seconds in it and the span it spent longest on: what the GPU waited
    for (an upload, the optimizer, the caller)."""
    own = clipped(tracks[compute], begin, end)
    holes = gaps(own, least)
    out = []
    for a, b in sorted(holes, key=lambda g: g[0] - g[1])[:count]:
        during = {}
        for track, spans in tracks.items():
            if track == compute:
                continue
            busy = union_length(clipped(spans, a, b))
            if busy > 0:
                longest = max((s for s in spans if s[1] > a and s[0] < b), key=lambda s: min(s[1], b) - max(s[0], a))
                during[track] = {"busy_s": busy, "longest": longest[2]}
        out.append({"at_s": a - begin, "idle_s": b - a,
                    "during": dict(sorted(during.items(), key=lambda kv: -kv[1]["busy_s"]))})
    return out


def task_times(tracks: dict[str, list[Span]], compute: Sequence[str], begin: float, end: float) -> list[dict]:
    """Each task on the compute tracks that starts in [begin, end): its start (from `begin`), its seconds and how
    many of them its stream waited for weights (the device's `weights wait` spans inside it, overlaps once:
    [Note: weight waits in the trace]). A task much slower than its neighbours with no weight wait is its host
    thread blocked before it queued its kernels."""
    rows = []
    for track in compute:
        waits = tracks.get(track.removesuffix(" compute") + " weights wait", [])
        for start, stop, name in tracks[track]:
            if begin <= start < end:
                rows.append({"track": track, "task": name, "start_s": start - begin, "seconds": stop - start,
                             "weights_wait_s": union_length(clipped(waits, start, stop))})
    return sorted(rows, key=lambda r: r["start_s"])


def bounds(steps_s: float, devices: int, flops_per_step: float | None, peak_tflops: float,
           pcie_bytes_per_step: float | None, pcie_gbps: float | None, host_step_s: float | None) -> dict:
    """The seconds per step each resource needs at least, and that bound's share of the measured step: compute
    (the step's FLOPs at `peak_tflops` on each of `devices`), PCIe (the busier direction's bytes at `pcie_gbps`
    on each device's own link; uploads and downloads overlap on a duplex link) and the host's optimizer step as
    given. A bound is None when its inputs are missing."""
    out = {}
    if flops_per_step and peak_tflops:
        out["compute"] = flops_per_step / (peak_tflops * 1e12 * devices)
    if pcie_bytes_per_step and pcie_gbps:
        out["pcie"] = pcie_bytes_per_step / (pcie_gbps * 1e9 * devices)
    if host_step_s:
        out["host_step"] = host_step_s
    return {name: {"bound_s": s, "share_of_step": s / steps_s if steps_s else None} for name, s in out.items()}


def workload_flops_per_step(workload: str, tokens_per_step: int | None = None) -> tuple[float, int]:
    """(FLOPs, tokens) of one step of a `benchmarks/workloads.py` workload, by `flops.workload_flops_per_token`
    (the MFU's count) at its first sequence length; tokens default to its global batch times that length."""
    from benchmarks.flops import workload_flops_per_token
    from benchmarks.workloads import WORKLOADS

    w = WORKLOADS[workload]
    seq = w.seqs[0]
    tokens = tokens_per_step or w.global_batch * seq
    return workload_flops_per_token(w.shape, seq, w.lora) * tokens, tokens


def summarize(trace: dict, steps: int | None = None, seconds: float | None = None, gap_count: int = 5,
              least_gap_s: float = 1e-3, flops_per_step: float | None = None,
              peak_tflops: float = DEFAULT_PEAK_TFLOPS, pcie_bytes_per_step: float | None = None,
              pcie_gbps: float | None = DEFAULT_PCIE_GBPS, host_step_s: float | None = None) -> dict:
    """Everything the table shows (see the module docstring), as one record. The PCIe bound uses the bytes the
    trace's copy spans name unless `pcie_bytes_per_step` is given; those names count what a copy call was handed,
    so an optimizer copy kept on the GPU and cast there (`upload_params_into`) is counted though it never crosses."""
    tracks = track_spans(trace)
    compute = compute_tracks(tracks)
    if not compute:
        raise ValueError("the trace has no compute or host task track: was it written by the engine?")
    begin, end, n = window(tracks, compute, steps, seconds)
    length = end - begin
    rows = {}
    for track, spans in sorted(tracks.items()):
        busy = union_length(clipped(spans, begin, end))
        moved = track_bytes(spans, begin, end)
        rows[track] = {"busy_s_per_step": busy / n, "share": busy / length if length else 0.0,
                       "spans": sum(1 for s in spans if begin <= s[0] < end),
                       "bytes_per_step": moved / n if moved else None,
                       "gbps": moved / busy / 1e9 if moved and busy else None}
    up = sum(r["bytes_per_step"] or 0 for t, r in rows.items() if t.endswith(UPLOADS))
    down = sum(r["bytes_per_step"] or 0 for t, r in rows.items() if t.endswith(DOWNLOADS))
    measured_pcie = max(up, down) / len(compute)  # per device: each has its own link
    pcie = pcie_bytes_per_step if pcie_bytes_per_step is not None else max(up, down)
    step_s = length / n
    return {
        "steps": n, "window_s": length, "step_s": step_s, "devices": len(compute), "compute_tracks": compute,
        "tracks": rows, "upload_bytes_per_step": up, "download_bytes_per_step": down,
        "pcie_bytes_per_step": pcie, "pcie_bytes_source": "given" if pcie_bytes_per_step is not None else "trace",
        "pcie_bytes_per_device_per_step": measured_pcie,
        "flops_per_step": flops_per_step, "peak_tflops": peak_tflops, "pcie_gbps": pcie_gbps,
        "bounds": bounds(step_s, len(compute), flops_per_step, peak_tflops, pcie, pcie_gbps, host_step_s),
        "compute_gaps": {t: idle_gaps(tracks, t, begin, end, least_gap_s, gap_count) for t in compute},
        "tasks": task_times(tracks, compute, begin, end),
    }


def _measured_for(bound: str, s: dict) -> float | None:
    """The measured busy seconds per step a bound is set against: the compute tracks' (per device), the upload
    tracks' (the link's busier direction, per device), the host optimizer track's."""
    rows = s["tracks"]
    if bound == "compute":
        return sum(rows[t]["busy_s_per_step"] for t in s["compute_tracks"]) / s["devices"]
    if bound == "pcie":
        up = sum(r["busy_s_per_step"] for t, r in rows.items() if t.endswith(UPLOADS))
        down = sum(r["busy_s_per_step"] for t, r in rows.items() if t.endswith(DOWNLOADS))
        return max(up, down) / s["devices"]
    return rows["optimizer"]["busy_s_per_step"] if "optimizer" in rows else None


def format_table(s: dict, name: str = "trace") -> str:
    """The summary as the lines a reader checks against the bounds: tracks, bounds, the compute track's gaps."""
    lines = [f"== {name}: {s['steps']} step(s) in {s['window_s']:.3f} s = {s['step_s']:.3f} s/step, "
             f"{s['devices']} device(s); PCIe {s['upload_bytes_per_step'] / 2**30:.2f} GiB up, "
             f"{s['download_bytes_per_step'] / 2**30:.2f} GiB down a step (from the copy spans)",
             f"  {'track':<34} {'busy s/step':>11} {'share':>6} {'spans':>6} {'GiB/step':>9} {'GB/s':>7}"]
    for track, r in s["tracks"].items():
        moved = f"{r['bytes_per_step'] / 2**30:9.3f}" if r["bytes_per_step"] else f"{'-':>9}"
        rate = f"{r['gbps']:7.1f}" if r["gbps"] else f"{'-':>7}"
        lines.append(f"  {track:<34} {r['busy_s_per_step']:11.4f} {r['share']:6.1%} {r['spans']:6d} {moved} {rate}")
    if s["bounds"]:
        lines.append(f"  {'bound':<12} {'bound s/step':>12} {'of step':>8} {'measured busy s/step':>21}")
        for bound, b in s["bounds"].items():
            measured = _measured_for(bound, s)
            shown = f"{measured:21.4f}" if measured is not None else f"{'-':>21}"
            lines.append(f"  {bound:<12} {b['bound_s']:12.4f} {b['share_of_step']:8.1%} {shown}")
    for track, holes in s["compute_gaps"].items():
        lines.append(f"  longest idle gaps of {track}:")
        for g in holes:
            during = "; ".join(f"{t} {d['busy_s'] * 1e3:.1f} ms ({d['longest'][:40]})"
                               for t, d in list(g["during"].items())[:4]) or "nothing traced"
            lines.append(f"    at {g['at_s']:.3f} s: {g['idle_s'] * 1e3:.1f} ms idle; {during}")
    lines.append(f"  tasks ({'start ms':>8}, {'ms':>8}, of which waiting for weights):")
    lines += [f"    {t['task']:<32} " + " ".join(f"{t[k] * 1e3:8.1f}" for k in ("start_s", "seconds", "weights_wait_s"))
              for t in s["tasks"]]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", help="a trace the engine wrote (.json or .json.gz)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--steps", type=int, default=None,
                       help="the last N passes (default: all but the first, the profiling pass)")
    which.add_argument("--seconds", type=float, default=None, help="the tasks that start in the last N seconds")
    parser.add_argument("--gaps", type=int, default=5, help="how many of the compute track's idle gaps to list")
    parser.add_argument("--least-gap-ms", type=float, default=1.0, help="the shortest idle gap listed")
    flops = parser.add_mutually_exclusive_group()
    flops.add_argument("--flops-per-step", type=float, default=None, help="model FLOPs of one step")
    flops.add_argument("--workload", default=None,
                       help="a benchmarks/workloads.py name: its FLOPs a step by benchmarks/flops.py")
    parser.add_argument("--tokens-per-step", type=int, default=None,
                        help="with --workload: tokens a step (default its global batch times its sequence)")
    parser.add_argument("--peak-tflops", type=float, default=DEFAULT_PEAK_TFLOPS)
    parser.add_argument("--pcie-bytes-per-step", type=float, default=None,
                        help="bytes one way a step (default: the busier direction's, from the copy spans)")
    parser.add_argument("--pcie-gbps", type=float, default=DEFAULT_PCIE_GBPS, help="GB/s one way, per device")
    parser.add_argument("--host-step-s", type=float, default=None,
                        help="the host optimizer step's bound, seconds a step (e.g. host_roofline.py's)")
    parser.add_argument("--json", action="store_true", help="print one JSON record instead of the table")
    args = parser.parse_args(argv)
    if args.tokens_per_step is not None and args.workload is None:
        parser.error("--tokens-per-step needs --workload")
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    flops_per_step, tokens = args.flops_per_step, args.tokens_per_step
    if args.workload:
        flops_per_step, tokens = workload_flops_per_step(args.workload, args.tokens_per_step)
    summary = summarize(load(args.trace), args.steps, args.seconds, args.gaps, args.least_gap_ms / 1e3,
                        flops_per_step, args.peak_tflops, args.pcie_bytes_per_step, args.pcie_gbps,
                        args.host_step_s)
    summary = {"trace": args.trace, "workload": args.workload, "tokens_per_step": tokens, **summary}
    print(json.dumps(summary) if args.json else format_table(summary, Path(args.trace).name))
    return summary


if __name__ == "__main__":
    main()
