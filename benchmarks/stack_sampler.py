"""Where each thread's wall time goes, from its Python stack sampled at a fixed interval.

cProfile and torch.profiler slow the Python they measure (twice or more for import-heavy start-up code), so their
shares of a start-up or an evaluation mislead where the real wall time is a few hundred milliseconds. This sampler
looks at every thread's current frame (`sys._current_frames`) every `interval_s` from a thread of its own and counts,
per thread, the innermost frame (where it is) and every distinct function on its stack (what it is inside). The
counts times the interval estimate wall time; a thread blocked in C (a CUDA sync, a lock, the GIL) is counted where
it blocks. The sampler needs the GIL to take a sample, so a thread that holds it for long spans is sampled less
often than the interval says: the shares are per thread, from the samples actually taken, and the sample count is
printed beside them.

    sampler = StackSampler(0.001); sampler.start(); ...; sampler.stop(); print(sampler.report())
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time


def _where(code) -> str:
    path = code.co_filename
    for marker in ("site-packages" + os.sep, "accelerate_roundpipe" + os.sep, "benchmarks" + os.sep):
        at = path.rfind(marker)
        if at >= 0:
            path = path[at + (len(marker) if marker.startswith("site") else 0):]
            break
    else:
        path = os.path.basename(path)
    return f"{path}:{code.co_name}"


_PARKED = {"threading.py:wait", "queue.py:get", "threading.py:_wait_for_tstate_lock"}


class StackSampler:
    def __init__(self, interval_s: float = 0.001, depth: int = 60) -> None:
        self.interval_s, self.depth = interval_s, depth
        self.leaf: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.inside: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.samples: collections.Counter = collections.Counter()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.wall_s = 0.0

    def start(self) -> None:
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.wall_s = time.perf_counter() - self._t0

    def _run(self) -> None:
        own = threading.get_ident()
        while not self._stop.wait(self.interval_s):
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == own:
                    continue
                name = names.get(ident, str(ident))
                self.samples[name] += 1
                self.leaf[name][_where(frame.f_code)] += 1
                seen = set()
                depth = 0
                while frame is not None and depth < self.depth:
                    where = _where(frame.f_code)
                    if where not in seen:
                        seen.add(where)
                        self.inside[name][where] += 1
                    frame, depth = frame.f_back, depth + 1

    def report(self, top: int = 40, threads: int = 6) -> str:
        lines = [f"stack samples over {self.wall_s:.3f} s (interval {self.interval_s * 1e3:.1f} ms):"]
        def busy(name: str) -> int:  # samples not parked in a wait: the threads that worked come first
            return self.samples[name] - sum(n for where, n in self.leaf[name].items() if where in _PARKED)

        for name in sorted(self.samples, key=busy, reverse=True)[:threads]:
            count = self.samples[name]
            scale = self.wall_s / count  # this thread's samples stand for the whole window
            lines.append(f"  thread {name}: {count} samples")
            lines.append("    inside (inclusive):")
            for where, n in self.inside[name].most_common(top):
                lines.append(f"      {n * scale * 1e3:9.1f} ms {100 * n / count:5.1f}%  {where}")
            lines.append("    at (innermost frame):")
            for where, n in self.leaf[name].most_common(top // 2):
                lines.append(f"      {n * scale * 1e3:9.1f} ms {100 * n / count:5.1f}%  {where}")
        return "\n".join(lines)
