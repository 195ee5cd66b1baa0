"""Read a timeline trace back: the measured bubble (and the part of it between passes), the time the GPUs waited for
weights inside their tasks, the simulator's bubble for the same tasks and measured costs, and a PNG Gantt chart.

    python -m accelerate_roundpipe.telemetry.report trace.json[.gz] [--png gantt.png] [--seconds 3]
        [--profile-out p.json]

Where a step's time goes track by track, and each task's time and weight waits: `benchmarks/step_bounds.py`.

[Note: weight waits in the trace]
A task's compute span runs from the first to the last event of its work on the compute stream, so it also covers
the stream's waits inside the task: for a layer's parameters to be written (the exact step of the layer below
still running on the host) and uploaded. Counted as busy, those waits hid a quarter-second stall per iteration of
Qwen3-4B under a 24 GiB cap behind a measured bubble of 0.0. So each wait is traced too (`Device.weights_wait`, a
span of the device's `weights wait` track from before the host may block on the version to after the stream has
passed the upload's event), and `waiting_for_weights` is their share of the device time: idle time the bubble
does not count.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections.abc import Sequence
from dataclasses import dataclass

from ..plan.schedule import Task
from ..plan.simulate import simulate


@dataclass(frozen=True)
class TaskSpan:
    track: str  # e.g. "d0(cuda:0) compute"
    task: Task
    start: float  # seconds
    end: float


@dataclass(frozen=True)
class WaitSpan:
    track: str  # the device's compute track, e.g. "d0(cuda:0) compute"
    start: float
    end: float


class TraceFileError(ValueError):
    """A trace file that cannot be read as a trace: missing, not JSON, or without `traceEvents`."""


def load_events(path: str) -> list[dict]:
    """The `traceEvents` of a trace file, plain JSON or gzipped (the benchmarks gzip theirs)."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
        events = json.loads(raw)["traceEvents"]
    except FileNotFoundError:
        raise TraceFileError(f"no trace file at {path!r}: give the path `trace_path` / ROUNDPIPE_TRACE wrote") from None
    except (OSError, EOFError, ValueError, KeyError, TypeError) as error:
        raise TraceFileError(f"{path!r} is not a RoundPipe trace (a Chrome trace JSON with `traceEvents`, plain or "
                             f"gzipped): {type(error).__name__}: {error}") from None
    if not isinstance(events, list):
        raise TraceFileError(f"{path!r}: `traceEvents` is not a list of events")
    return events


def _track_names(events: list[dict]) -> dict:
    return {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}


def load_weight_waits(path: str | list[dict]) -> list[WaitSpan]:
    """The weight waits of a trace ([Note: weight waits in the trace]), each on its device's compute track; `path`
    a trace file or its loaded events."""
    events = load_events(path) if isinstance(path, str) else path
    names = _track_names(events)
    suffix = " weights wait"
    return sorted((WaitSpan(names[e["tid"]][:-len(suffix)] + " compute", e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6)
                   for e in events if e.get("ph") == "X" and names[e["tid"]].endswith(suffix)),
                  key=lambda w: w.start)


def waiting_for_weights(spans: Sequence[TaskSpan], waits: Sequence[WaitSpan]) -> float:
    """The share of the device time (as in `measured_bubble`) the compute streams waited for weights inside the
    task spans, the overlaps of waits on one track counted once."""
    total = _device_time(spans) if spans else 0.0
    if total <= 0:
        return 0.0
    begin, end = min(s.start for s in spans), max(s.end for s in spans)
    waited = 0.0
    for track in {w.track for w in waits}:
        reach = None
        for w in (w for w in waits if w.track == track):
            start, stop = max(w.start, begin, reach or begin), min(w.end, end)
            if stop > start:
                waited += stop - start
            reach = stop if reach is None else max(reach, stop)
    return waited / total


def load_task_spans(path: str | list[dict]) -> list[TaskSpan]:
    """The task spans of a trace: GPU compute spans when the trace has them, else the workers' host spans; `path`
    a trace file or its loaded events."""
    events = load_events(path) if isinstance(path, str) else path
    names = _track_names(events)
    kind = "compute" if any(n.endswith(" compute") for n in names.values()) else "host"
    spans = []
    for e in events:
        if e.get("ph") == "X" and names[e["tid"]].endswith(" " + kind):
            spans.append(TaskSpan(names[e["tid"]], Task.from_str(e["name"]), e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6))
    return sorted(spans, key=lambda s: s.start)


def _with_previous_end(spans: Sequence[TaskSpan]):
    """Each span, per track in start order, with the latest end of the spans before it on its track (None first)."""
    for track in {s.track for s in spans}:
        last_end = None
        for s in sorted((s for s in spans if s.track == track), key=lambda s: s.start):
            yield s, last_end
            last_end = s.end if last_end is None else max(last_end, s.end)


def _device_time(spans: Sequence[TaskSpan]) -> float:
    """The window from the first task's start to the last task's end, times the number of devices."""
    window = max(s.end for s in spans) - min(s.start for s in spans)
    return window * len({s.track for s in spans})


def measured_bubble(spans: Sequence[TaskSpan]) -> float:
    """Idle share of the devices between the first task's start and the last task's end."""
    total = _device_time(spans) if spans else 0.0
    if total <= 0:
        return 0.0
    busy = sum(max(0.0, s.end - (s.start if prev is None else max(s.start, prev)))
               for s, prev in _with_previous_end(spans))
    return 1.0 - busy / total


def _starts_a_pass(task: Task) -> bool:
    return task.kind.value in ("F", "FB") and task.span.start == 0 and task.microbatches.start == 0


def idle_between_passes(spans: Sequence[TaskSpan]) -> float:
    """The devices' idle time just before each pass's first task (a gap the next pass could have filled: the
    caller's step, data loading, a host synchronisation), as a share of the window, like `measured_bubble`."""
    total = _device_time(spans) if spans else 0.0
    if total <= 0:
        return 0.0
    idle = sum(max(0.0, s.start - prev) for s, prev in _with_previous_end(spans)
               if prev is not None and _starts_a_pass(s.task))
    return idle / total


def last_seconds(spans: Sequence[TaskSpan], seconds: float | None) -> list[TaskSpan]:
    """The spans that start in the trace's last `seconds` (the steady state, past warm-up and profiling)."""
    if seconds is None or not spans:
        return list(spans)
    cut = max(s.end for s in spans) - seconds
    return [s for s in spans if s.start >= cut]


def simulated_bubble(spans: Sequence[TaskSpan], num_devices: int) -> float:
    """The simulator's bubble for the same tasks in the same order, each micro-batch costing its measured share."""
    tasks, costs, offset, seen_rounds = [], {}, 0, set()
    for s in spans:
        task = s.task
        if task.kind.value in ("F", "FB") and task.span.start == 0 and (offset + task.round_index) in seen_rounds:
            offset = max(seen_rounds) + 1  # a new pass: its rounds are chains of their own
        task = task._replace(round_index=offset + task.round_index)
        seen_rounds.add(task.round_index)
        tasks.append(task)
        costs[len(tasks) - 1] = (s.end - s.start) / len(range(*task.microbatches))
    index = {id(t): i for i, t in enumerate(tasks)}
    return simulate(tasks, num_devices, lambda t, mb: costs[index[id(t)]]).bubble_ratio


def layer_profile(spans: Sequence[TaskSpan], backward_ratio: float = 3.0) -> list[float]:
    """Per-layer forward cost (seconds per micro-batch) measured from a trace, for `accelerate-roundpipe simulate
    --profile`: each task's time per micro-batch spread evenly over its layers, backward and fused tasks divided by
    `backward_ratio`; a layer's cost is the median over the tasks that ran it."""
    samples: dict[int, list[float]] = {}
    for s in spans:
        per_mb = (s.end - s.start) / len(range(*s.task.microbatches))
        factor = 1.0 if s.task.kind.value == "F" else backward_ratio
        for layer in s.task.span.layers:
            samples.setdefault(layer, []).append(per_mb / len(s.task.span) / factor)
    if not samples:
        return []
    layers = range(max(samples) + 1)
    return [sorted(samples[i])[len(samples[i]) // 2] if i in samples else 0.0 for i in layers]


def gantt_png(spans: Sequence[TaskSpan], path: str, seconds: float | None = None,
              waits: Sequence[WaitSpan] = ()) -> str:
    """A Gantt chart of the task spans (F blue, FB red, B green), the weight waits inside them in black;
    `seconds` limits it to the last N seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spans = last_seconds(spans, seconds)
    origin = min(s.start for s in spans)
    tracks = sorted({s.track for s in spans})
    colours = {"F": "#4C72B0", "FB": "#C44E52", "B": "#55A868"}
    fig, ax = plt.subplots(figsize=(12, 0.6 + 0.5 * len(tracks)))
    for row, track in enumerate(tracks):
        for s in (s for s in spans if s.track == track):
            ax.barh(row, s.end - s.start, left=s.start - origin, color=colours[s.task.kind.value], edgecolor="white",
                    linewidth=0.3)
        for w in (w for w in waits if w.track == track and w.start >= origin and w.end - w.start > 1e-4):
            ax.barh(row, w.end - w.start, left=w.start - origin, height=0.4, color="black")
    ax.set_yticks(range(len(tracks)), tracks)
    ax.set_xlabel("seconds")
    title = "RoundPipe timeline (F: forward, FB: fused, B: backward"
    ax.set_title(title + (", black: waiting for weights)" if waits else ")"))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("--png", default=None)
    parser.add_argument("--seconds", type=float, default=None,
                        help="only the tasks that start in the last N seconds (the steady state), for the numbers "
                             "and the chart")
    parser.add_argument("--profile-out", default=None,
                        help="write per-layer costs measured from the trace (for `accelerate-roundpipe simulate "
                             "--profile`)")
    args = parser.parse_args(argv)
    try:
        events = load_events(args.trace)
    except TraceFileError as error:  # a command line gets one line and exit status 2, as argparse gives
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    spans = last_seconds(load_task_spans(events), args.seconds)
    waits = load_weight_waits(events)
    num_devices = len({s.track for s in spans})
    report = {"measured_bubble": round(measured_bubble(spans), 4),
              "idle_between_passes": round(idle_between_passes(spans), 4),
              "waiting_for_weights": round(waiting_for_weights(spans, waits), 4),
              "simulated_bubble": round(simulated_bubble(spans, num_devices), 4), "tasks": len(spans)}
    print(json.dumps(report))
    if args.png:
        gantt_png(spans, args.png, waits=waits)
    if args.profile_out:
        with open(args.profile_out, "w") as f:
            json.dump({"forward": layer_profile(spans)}, f)
    return report


if __name__ == "__main__":
    main()
