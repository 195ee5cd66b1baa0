"""Timeline recording: every worker's tasks (host side and, on CUDA, the compute stream), gradient commits, the
optimizer thread and the caller, written as a Chrome/Perfetto trace (open it in https://ui.perfetto.dev).

Off by default: the engine then holds no recorder and every hook is a `None` check. On CUDA, GPU time comes from
events recorded on the compute stream around each task, converted to the host clock at save time (one event pair
anchors the two clocks), so recording never synchronises the device while the pipeline runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class _Span:
    track: str
    name: str
    start: float  # seconds, host clock (perf_counter)
    end: float
    args: dict[str, Any] | None = None


class TraceRecorder:
    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self._spans: list[_Span] = []
        self._cuda: list[tuple[str, str, Any, Any]] = []  # track, name, start event, end event
        self._anchors: dict[str, tuple[Any, float]] = {}  # device -> (event, host time at record)
        self._lock = threading.Lock()
        self.origin = time.perf_counter()

    @contextlib.contextmanager
    def span(self, track: str, name: str, **args: Any) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            with self._lock:
                self._spans.append(_Span(track, name, start, time.perf_counter(), args or None))

    def cuda_events(self, device: torch.device, stream) -> tuple[Any, Any]:
        """A (start, end) event pair for a span of `stream`'s work; record them around the work."""
        key = str(device)
        if key not in self._anchors:
            anchor = torch.cuda.Event(enable_timing=True)
            anchor.record(stream)
            anchor.synchronize()  # once per device: ties the GPU clock to the host clock
            self._anchors[key] = (anchor, time.perf_counter())
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def add_cuda_span(self, track: str, name: str, device: torch.device, start_event, end_event) -> None:
        with self._lock:
            self._cuda.append((track, name, str(device), start_event, end_event))

    def spans(self) -> list[_Span]:
        """Every span so far, GPU spans converted to the host clock (synchronises their events)."""
        with self._lock:
            spans = list(self._spans)
            cuda = list(self._cuda)
        for track, name, device, start_event, end_event in cuda:
            anchor, anchor_host = self._anchors[device]
            end_event.synchronize()
            start = anchor_host + anchor.elapsed_time(start_event) / 1e3
            end = anchor_host + anchor.elapsed_time(end_event) / 1e3
            spans.append(_Span(track, name, start, end))
        return sorted(spans, key=lambda s: s.start)

    def to_chrome(self) -> dict[str, Any]:
        tracks: dict[str, int] = {}
        events = []
        for s in self.spans():
            tid = tracks.setdefault(s.track, len(tracks))
            event = {"name": s.name, "ph": "X", "pid": 0, "tid": tid, "ts": (s.start - self.origin) * 1e6,
                     "dur": max(s.end - s.start, 0.0) * 1e6}
            if s.args:
                event["args"] = {k: str(v) for k, v in s.args.items()}
            events.append(event)
        for track, tid in tracks.items():
            events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": track}})
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def save(self, path: str | os.PathLike | None = None) -> str:
        target = os.fspath(path) if path is not None else self.path
        directory = os.path.dirname(os.path.abspath(target))
        os.makedirs(directory, exist_ok=True)
        tmp = f"{target}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.to_chrome(), f)
        os.replace(tmp, target)  # never leave a half-written trace
        return target


def maybe_span(recorder: TraceRecorder | None, track: str, name: str, **args: Any):
    return recorder.span(track, name, **args) if recorder is not None else contextlib.nullcontext()
