"""Per-layer costs and the weight uploads' rate measured on a training pass, for the planner (`plan/planner.py`,
`plan/one_device.py`, `plan/microbatch_choice.py`).

While a pass is profiled, the workers time every layer run with their device's `timer()` (on a GPU, CUDA events on
the compute stream, read after the pass, so nothing waits on the GPU; wall time on CPU workers), and on a device that
`tracks_memory` (CUDA's caching allocator) read its counters around each forward that builds a graph and each
backward (host-side counters, no device sync): a forward's growth is the activation memory the layer keeps for its
backward (`act_bytes`); the peak above that, in the forward or in the backward, is its working set (`work_bytes`).
Forwards without a graph give `forward_s`, forwards with a graph `recompute_s`, the per-layer backward segments
`backward_s`. The residency times every batch of weight uploads it issues (`measure_upload`: on a GPU, CUDA events
on the parameter-upload stream around the copies, so a copy queued behind another is timed from when it runs), and
`upload_bytes_per_s` is the rate of the slowest device's uploads over the pass: the link the planner's transfer
times and the transfer verdict use ([Note: transfers sized to the batch]).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum

import torch

from ...plan.layer_costs import LayerCosts
from ..state.host_store import HostStore


class LayerRun(str, Enum):
    """What one measurement times: one layer's run over one micro-batch, inside a task of any `TaskKind`."""

    FORWARD = "forward"  # no graph (a forward stage): gives forward_s
    FORWARD_WITH_GRAPH = "forward_with_graph"  # a recomputation or the fused stage's forward: gives recompute_s
    BACKWARD = "backward"  # the layer's segment of a backward: gives backward_s


class LayerProfile:
    """Measurements of one pass; workers add to it from their threads."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self._lock = threading.Lock()
        self._timers: dict[tuple[LayerRun, int], list] = defaultdict(list)
        self._act_bytes: dict[int, int] = defaultdict(int)
        self._input_bytes: dict[int, int] = defaultdict(int)
        self._work_bytes: dict[int, int] = defaultdict(int)
        self._uploads: dict[int, list] = defaultdict(list)  # device index -> (bytes, timer) per batch of uploads

    @contextmanager
    def measure(self, run: LayerRun, layer: int, device, inputs: tuple = ()) -> Iterator[None]:
        memory = device.tracks_memory and run is not LayerRun.FORWARD
        if memory:
            device.reset_peak_memory()  # this layer's transient peak
            before = device.allocated_bytes()
        timer = device.timer()
        yield
        timer.stop()
        grown = work = 0
        if memory:
            after = device.allocated_bytes()
            peak = device.peak_allocated_bytes() - before
            grown = after - before if run is LayerRun.FORWARD_WITH_GRAPH else 0
            work = max(0, peak - max(grown, 0))
        size = sum(t.numel() * t.element_size() for t in inputs if isinstance(t, torch.Tensor))
        with self._lock:
            self._timers[(run, layer)].append(timer)
            self._act_bytes[layer] = max(self._act_bytes[layer], grown)
            self._work_bytes[layer] = max(self._work_bytes[layer], work)
            if inputs:
                self._input_bytes[layer] = max(self._input_bytes[layer], size)

    @contextmanager
    def measure_upload(self, device, num_bytes: int) -> Iterator[None]:
        """Time the weight uploads of `num_bytes` host bytes queued inside (on `device`'s upload stream)."""
        timer = device.upload_timer()
        yield
        timer.stop()
        with self._lock:
            self._uploads[device.index].append((num_bytes, timer))

    def upload_bytes_per_s(self) -> float | None:
        """Host-to-device bytes per second of the device whose uploads ran slowest (waits for their events); None
        when nothing was timed (no uploads, or a device whose copies take no measurable time)."""
        rates = []
        for uploads in self._uploads.values():
            num_bytes = sum(n for n, _ in uploads)
            seconds = sum(t.elapsed_s() for _, t in uploads)
            if num_bytes > 0 and seconds > 0:
                rates.append(num_bytes / seconds)
        return min(rates) if rates else None

    def _mean(self, run: LayerRun, layer: int) -> float | None:
        timers = self._timers.get((run, layer))
        return sum(t.elapsed_s() for t in timers) / len(timers) if timers else None

    def layer_costs(self, store: HostStore) -> LayerCosts:
        """Mean time per micro-batch of every layer (waits for the pass's events) and its bytes."""
        forward, recompute, backward = [], [], []
        for layer in range(self.num_layers):
            with_graph = self._mean(LayerRun.FORWARD_WITH_GRAPH, layer)
            without = self._mean(LayerRun.FORWARD, layer)
            forward.append(without if without is not None else with_graph or 0.0)
            recompute.append(with_graph if with_graph is not None else forward[-1])
            backward.append(self._mean(LayerRun.BACKWARD, layer) or 2 * forward[-1])
        params, grads, uploads, downloads = [], [], [], []
        for layer in range(self.num_layers):  # what its tasks move: its row windows only ([Note: row windows])
            params.append(store.window_bytes(range(layer, layer + 1)))
            grads.append(store.window_bytes(range(layer, layer + 1), trainable_only=True))
            up, down = _crossing_bytes(store, layer)
            uploads.append(up)
            downloads.append(down)
        return LayerCosts(forward_s=forward, backward_s=backward, recompute_s=recompute, param_bytes=params,
                          grad_bytes=grads, act_bytes=[self._act_bytes[i] for i in range(self.num_layers)],
                          input_bytes=[self._input_bytes[i] for i in range(self.num_layers)],
                          work_bytes=[max(self._work_bytes[i], self._act_bytes[i]) for i in range(self.num_layers)],
                          upload_bytes=uploads, download_bytes=downloads)


def _crossing_bytes(store: HostStore, layer: int) -> tuple[int, int]:
    """What a task running `layer` puts on PCIe: its buckets' compute-copy windows up, and the trainable ones'
    gradients down in the host's gradient dtype (the optimizer copy's), for the buckets whose optimizer state is on
    the host. A bucket with a home device is read and stepped there ([Note: optimizer placement]): after its first
    step nothing of it crosses (the measured pass itself, before any step, still uploads it)."""
    up = down = 0
    layers = range(layer, layer + 1)
    for index in store.buckets_of_layers(layers):
        bucket = store.buckets[index]
        if not bucket.tier.crosses_pcie:  # [Note: state tiers]
            continue
        start, stop = store.window(layers, index)
        up += (stop - start) * bucket.compute.element_size()
        if bucket.trainable:
            grad_dtype = bucket.optim if bucket.optim is not None else bucket.compute
            down += (stop - start) * grad_dtype.element_size()
    return up, down
