"""Timeline recording: every worker's tasks (host side and, on CUDA, the compute stream), gradient commits, the
optimizer thread and the caller, written as a Chrome/Perfetto trace (open it in https://ui.perfetto.dev).

Off by default: the engine then holds no recorder and every hook is a `None` check. When recording, the trace is
written at the end of training (`Trainer.train()`, `accelerator.end_training()`), at `close()` and `save_trace()`,
and otherwise when the engine is freed or the process exits ([Note: trace at exit]). On CUDA, GPU time comes from
events recorded on the compute stream around each task, converted to the host clock at save time (one event pair
anchors the two clocks), so recording never synchronises the device while the pipeline runs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .summary import announce

logger = logging.getLogger(__name__)


@dataclass
class _Span:
    track: str
    name: str
    start: float  # seconds, host clock (perf_counter)
    end: float
    args: dict[str, Any] | None = None


def rank_trace_path(path: str | os.PathLike, rank: int, world_size: int) -> str:
    """[Note: one trace per rank]
    Under data parallelism a launcher exports one `ROUNDPIPE_TRACE` to every rank: written as given, the ranks
    wrote the same file through the same temporary name, and one rank's rename found the other's gone
    (`FileNotFoundError` at the end of `train()`). Each rank writes `<stem>.rank<r>-of-<n><ext>` instead (the
    optimizer shards' naming), its events under process id r, so that the files opened together in Perfetto show
    the ranks side by side."""
    stem, ext = os.path.splitext(os.fspath(path))
    return f"{stem}.rank{rank}-of-{world_size}{ext}"


class TraceRecorder:
    def __init__(self, path: str | os.PathLike, rank: int | None = None, world_size: int = 1) -> None:
        # With `rank` (data parallelism), every path written gets the rank in its name ([Note: one trace per rank]).
        self.rank, self.world_size = rank, world_size
        self.path = self._for_rank(path)
        self._spans: list[_Span] = []
        self._cuda: list[tuple[str, str, Any, Any]] = []  # track, name, start event, end event
        self._anchors: dict[str, tuple[Any, float]] = {}  # device -> (event, host time at record)
        self._lock = threading.Lock()
        self.origin = time.perf_counter()
        self._saved_count = 0  # spans in the file last written to `self.path`

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

    @property
    def num_spans(self) -> int:
        with self._lock:
            return len(self._spans) + len(self._cuda)

    @property
    def has_unsaved_spans(self) -> bool:
        """Spans were recorded since the trace was last written to `self.path`."""
        return self.num_spans > self._saved_count

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

    def _for_rank(self, path: str | os.PathLike) -> str:
        return os.fspath(path) if self.rank is None else rank_trace_path(path, self.rank, self.world_size)

    def to_chrome(self) -> dict[str, Any]:
        tracks: dict[str, int] = {}
        events = []
        pid = self.rank or 0
        for s in self.spans():
            tid = tracks.setdefault(s.track, len(tracks))
            event = {"name": s.name, "ph": "X", "pid": pid, "tid": tid, "ts": (s.start - self.origin) * 1e6,
                     "dur": max(s.end - s.start, 0.0) * 1e6}
            if s.args:
                event["args"] = {k: str(v) for k, v in s.args.items()}
            events.append(event)
        for track, tid in tracks.items():
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": track}})
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def save(self, path: str | os.PathLike | None = None) -> str:
        target = self._for_rank(path) if path is not None else self.path
        directory = os.path.dirname(os.path.abspath(target))
        os.makedirs(directory, exist_ok=True)
        count = self.num_spans
        tmp = f"{target}.{os.getpid()}.tmp"  # two writers of one path never share the temporary file
        with open(tmp, "w") as f:
            json.dump(self.to_chrome(), f)
        os.replace(tmp, target)  # never leave a half-written trace
        if path is None:
            self._saved_count = count
        return target


def maybe_span(recorder: TraceRecorder | None, track: str, name: str, **args: Any):
    return recorder.span(track, name, **args) if recorder is not None else contextlib.nullcontext()


def save_when_freed(owner: object, recorder: TraceRecorder, announce_path: bool) -> weakref.finalize:
    """Write `recorder`'s trace when `owner` (the engine) is freed or the process exits; call the returned
    finalizer's `detach()` once the trace was written otherwise.

    [Note: trace at exit]
    The ways in never call `close()`: a Trainer, a stock Accelerate loop or a launched script just end, so a trace
    written only at `close()` was never written. The end-of-training hooks (the Trainer's `on_train_end`,
    `accelerator.end_training()`) write the whole trace after synchronizing; this finalizer is the fallback for
    everything else. It holds the recorder, never the engine (a finalizer holding its object would keep it alive
    forever), and writes what was recorded without waiting for work in flight: at exit, a step may wait for
    gradients of a pass nobody will back-propagate. Created with the engine, before its threads' finalizer, it runs
    after that one at exit (finalizers run in reverse order of creation), once the threads have stopped adding spans.
    It writes only when spans were recorded since the last write (e.g. an evaluation after training), so a run whose
    training end wrote the trace is not written twice.
    """
    return weakref.finalize(owner, _save_quietly, recorder, announce_path)


def _save_quietly(recorder: TraceRecorder, announce_path: bool) -> None:
    if not recorder.has_unsaved_spans:
        return  # the end of training wrote it, and nothing ran since
    try:
        path = recorder.save()
    except Exception as error:  # at exit nobody can catch it; say what was lost instead
        logger.warning("RoundPipe could not write its trace to %s: %s", recorder.path, error)
        return
    announce(f"trace written to {path} (open it in https://ui.perfetto.dev)", announce_path)
