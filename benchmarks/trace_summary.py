"""What a torch.profiler (Kineto) chrome trace says about a window of training steps: where the GPU's time went,
where it sat idle, and what the host threads did meanwhile.

Plain functions over the trace's JSON (`{"traceEvents": [...]}`), so the summary can be tested without a GPU and
re-run on a trace brought back from the device. Times in the trace are microseconds; the summary's are milliseconds
per step.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Iterable

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
IDLE_GAP_US = 500.0  # a GPU gap at least this long is listed with what the host threads ran during it


def all_threads_config():
    """Kineto's config recording every thread's host ops (RoundPipe's workers and optimizer are threads the caller
    did not start under the profiler) and the CUDA synchronizations; None where this torch lacks them."""
    from torch._C._profiler import _ExperimentalConfig

    try:
        return _ExperimentalConfig(profile_all_threads=True, enable_cuda_sync_events=True)
    except TypeError:
        print("warning: this torch cannot profile every thread; only the caller's host ops are recorded")
        return None


def _intervals(events: Iterable[dict]) -> list[tuple[float, float]]:
    return sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in events)


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of sorted (start, end) intervals."""
    total, end = 0.0, float("-inf")
    for a, b in intervals:
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def gaps(intervals: list[tuple[float, float]], least: float) -> list[tuple[float, float]]:
    """The holes of at least `least` between the union of sorted intervals."""
    out, end = [], None
    for a, b in intervals:
        if end is not None and a - end >= least:
            out.append((end, a))
        end = b if end is None else max(end, b)
    return out


def _top(durations: dict[str, list[float]], steps: int, count: int) -> list[dict]:
    rows = sorted(durations.items(), key=lambda kv: -sum(kv[1]))[:count]
    return [{"name": name[:120], "calls_per_step": round(len(d) / steps, 2),
             "ms_per_step": round(sum(d) / steps / 1e3, 3)} for name, d in rows]


def _top_level(events: list[dict]) -> list[dict]:
    """The host ops of one thread that no other op of it encloses."""
    out, end = [], float("-inf")
    for e in sorted(events, key=lambda e: (float(e["ts"]), -float(e.get("dur", 0.0)))):
        if float(e["ts"]) >= end:
            out.append(e)
            end = float(e["ts"]) + float(e.get("dur", 0.0))
    return out


def summarize(trace: dict, steps: int, top: int = 12, thread_names: dict[str, str] | None = None) -> dict:
    """The summary of a trace covering `steps` training steps (see the module docstring); `thread_names` maps the
    trace's thread ids (native ids) to names."""
    names = thread_names or {}
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    by_cat: dict[str, list[dict]] = collections.defaultdict(list)
    for e in events:
        by_cat[e.get("cat", "")].append(e)
    gpu = [e for c in GPU_CATEGORIES for e in by_cat.get(c, [])]
    host_spans = _intervals(e for e in by_cat.get("cpu_op", []))
    if not gpu and not host_spans:
        raise ValueError("the trace holds no GPU activity and no host op: was anything profiled?")
    spans = _intervals(gpu)
    window_spans = spans or host_spans  # a CPU-only trace: the window is the host ops' span, the GPU fields 0
    window = window_spans[-1][1] - window_spans[0][0]
    busy = union_length(spans)
    per_kernel: dict[str, list[float]] = collections.defaultdict(list)
    for e in by_cat.get("kernel", []):
        per_kernel[e["name"]].append(float(e.get("dur", 0.0)))
    copies: dict[str, list[float]] = collections.defaultdict(list)
    for c in ("gpu_memcpy", "gpu_memset"):
        for e in by_cat.get(c, []):
            copies[e["name"]].append(float(e.get("dur", 0.0)))
    runtime: dict[str, list[float]] = collections.defaultdict(list)
    for e in by_cat.get("cuda_runtime", []) + by_cat.get("cuda_driver", []):
        runtime[e["name"]].append(float(e.get("dur", 0.0)))
    host_ops = [e for e in by_cat.get("cpu_op", []) + by_cat.get("user_annotation", [])
                if "ProfilerStep" not in e["name"]]
    threads: dict[str, list[dict]] = collections.defaultdict(list)
    for e in host_ops:
        tid = str(e.get("tid"))
        threads[names.get(tid, tid)].append(e)
    tops = {tid: _top_level(evs) for tid, evs in threads.items()}
    per_thread = sorted(({"thread": tid, "busy_ms_per_step": round(union_length(_intervals(evs)) / steps / 1e3, 3),
                          "ops_per_step": round(len(evs) / steps, 1)} for tid, evs in tops.items()),
                        key=lambda r: -r["busy_ms_per_step"])
    idle = gaps(spans, IDLE_GAP_US)
    listed = []
    for a, b in sorted(idle, key=lambda g: g[0] - g[1])[:top]:
        during = collections.Counter()
        for tid, evs in tops.items():
            for e in evs:
                s, f = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))
                overlap = min(b, f) - max(a, s)
                if overlap > 0:
                    during[f"{tid}:{e['name'][:60]}"] += overlap
        listed.append({"at_ms": round((a - window_spans[0][0]) / 1e3, 3), "ms": round((b - a) / 1e3, 3),
                       "host": [f"{name} {us / 1e3:.2f} ms" for name, us in during.most_common(4)]})
    return {
        "steps": steps,
        "window_ms_per_step": round(window / steps / 1e3, 3),
        "gpu_busy_ms_per_step": round(busy / steps / 1e3, 3),
        "gpu_busy_share": round(busy / window, 4) if window else 0.0,
        "kernels_per_step": round(len(by_cat.get("kernel", [])) / steps, 1),
        "kernel_ms_per_step": round(sum(sum(d) for d in per_kernel.values()) / steps / 1e3, 3),
        "idle_gaps_per_step": round(len(idle) / steps, 2),
        "idle_gap_ms_per_step": round(sum(b - a for a, b in idle) / steps / 1e3, 3),
        "top_kernels": _top(per_kernel, steps, top),
        "copies": _top(copies, steps, top),
        "runtime_calls": _top(runtime, steps, top),
        "threads": per_thread,
        "longest_idle_gaps": listed,
    }


def format_summary(name: str, s: dict) -> str:
    """The summary as the lines a reader compares across systems."""
    lines = [f"== {name}: {s['window_ms_per_step']} ms/step (GPU window), GPU busy {s['gpu_busy_ms_per_step']} ms "
             f"({s['gpu_busy_share']:.0%}), {s['kernels_per_step']} kernels/step = {s['kernel_ms_per_step']} ms, "
             f"idle gaps >= {IDLE_GAP_US / 1e3} ms: {s['idle_gaps_per_step']}/step = {s['idle_gap_ms_per_step']} ms"]
    for title in ("top_kernels", "copies", "runtime_calls"):
        lines.append(f"  {title}:")
        lines += [f"    {r['ms_per_step']:8.3f} ms {r['calls_per_step']:7.1f}x  {r['name']}" for r in s[title]]
    lines.append("  host threads (top-level ops):")
    lines += [f"    {r['busy_ms_per_step']:8.3f} ms {r['ops_per_step']:7.1f} ops  thread {r['thread']}"
              for r in s["threads"][:8]]
    lines.append("  longest GPU idle gaps:")
    lines += [f"    at {g['at_ms']} ms: {g['ms']} ms; host: {'; '.join(g['host'])}" for g in s["longest_idle_gaps"]]
    return "\n".join(lines)


def load(path: str) -> dict:
    import gzip

    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)
