"""Live metrics: tokens/s, MFU, GPU peak memory and host memory, logged by a Trainer callback.

The engine counts the tokens (rows x sequence positions of the first input) and the passes it ran; the callback turns
the counts between two logging steps into rates and adds them to the Trainer's logs (so they reach the console,
TensorBoard, W&B, ...) under `roundpipe/...` keys.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .trace import TraceRecorder


@dataclass
class EngineCounters:
    tokens: int = 0
    passes: int = 0
    started: float = field(default_factory=time.perf_counter)

    def count(self, first_input: torch.Tensor) -> None:
        self.tokens += first_input.shape[0] * (first_input.shape[1] if first_input.dim() > 1 else 1)
        self.passes += 1


def host_rss_gib() -> float:
    """Resident memory of this process (Linux /proc; 0 where unavailable)."""
    try:
        with open(f"/proc/{os.getpid()}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


class MemoryGauge(Protocol):
    """A device's memory peak, read at each sample (the runtime's devices are gauges)."""

    tracks_memory: bool  # the device counts its allocated memory

    def peak_allocated_bytes(self) -> int | None:
        """The most memory allocated since the last reset; None where the device does not count its memory."""


def gpu_peak_gib(devices: Iterable[MemoryGauge]) -> float:
    """The highest peak of allocated memory among the devices that count theirs (0 for CPU workers)."""
    peaks = [peak for peak in (d.peak_allocated_bytes() for d in devices) if peak is not None]
    return max(peaks, default=0) / 2**30


class MetricsWindow:
    """Rates between two calls of `sample()`.

    It reads what changes while the engine runs, live, through telemetry's own types: `counters`, the engine's
    `EngineCounters` (the tokens it ran), `trace`, its `TraceRecorder` (None when no trace is recorded: no bubble),
    and `devices`, the gauges of its devices' memory peaks. A snapshot (`engine_view.py`) would be stale at the
    next log; these are read at each `sample()`, and nothing else of the engine is."""

    def __init__(self, counters: EngineCounters, trace: TraceRecorder | None, devices: Sequence[MemoryGauge] = (),
                 flops_per_token: float | None = None, peak_flops: float | None = None) -> None:
        self.counters, self.trace, self.devices = counters, trace, tuple(devices)
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self._tokens = counters.tokens
        self._time = time.perf_counter()

    def sample(self) -> dict[str, float]:
        now, tokens = time.perf_counter(), self.counters.tokens
        since, elapsed = self._time, max(now - self._time, 1e-9)
        rate = (tokens - self._tokens) / elapsed
        self._tokens, self._time = tokens, now
        metrics = {"roundpipe/tokens_per_s": round(rate, 1), "roundpipe/host_rss_gib": round(host_rss_gib(), 2)}
        if any(d.tracks_memory for d in self.devices):
            metrics["roundpipe/gpu_peak_gib"] = round(gpu_peak_gib(self.devices), 2)
        if self.flops_per_token and self.peak_flops:
            metrics["roundpipe/mfu"] = round(rate * self.flops_per_token / self.peak_flops, 4)
        if self.trace is not None:
            metrics["roundpipe/bubble"] = round(self._measured_bubble(since), 4)
        return metrics

    def _measured_bubble(self, since: float) -> float:
        """Idle share of the devices' task spans (GPU compute, else worker host) recorded since `since`."""
        from .report import measured_bubble

        spans = [s for s in self.trace.spans() if s.start >= since]
        kind = " compute" if any(s.track.endswith(" compute") for s in spans) else " host"
        return measured_bubble([s for s in spans if s.track.endswith(kind)])


def training_flops_per_token(trainable_params: int, frozen_params: int = 0, layers: int = 0,
                             attention_width: int = 0, seq_len: int = 0) -> float:
    """Model FLOPs of one trained token, the MFU basis of PaLM (Chowdhery et al. 2022, appendix B).

    Each matrix-multiply weight costs 2 FLOPs per token forward and 2 for the input gradient; a trainable one costs
    2 more for its weight gradient: 6 x `trainable_params` + 4 x `frozen_params` (a LoRA base is frozen, its
    adapters trainable). Attention adds, per layer, QK^T and AV over the causal half of the sequence: 2 x
    `seq_len` x `attention_width` (heads x head_dim) forward, 3 times that with its backward. Model FLOPs, not
    hardware FLOPs: recomputation is not counted, so a plan that recomputes does not look busier than one that
    keeps its activations, and systems that checkpoint differently compare on the same work. Not counted: the
    input embedding (a gather), norms, biases and the loss (under 0.5% at these sizes), and that a frozen bottom
    layer needs no input gradient.
    """
    attention = 6.0 * layers * attention_width * seq_len
    return 6.0 * trainable_params + 4.0 * frozen_params + attention


def _matmul_params(model: torch.nn.Module) -> tuple[float, float]:
    """(trainable, frozen) elements of the matrices a model multiplies one token by: every parameter of two or more
    dimensions held by a module other than an embedding (a tied LM head counts once, through the head); in a
    mixture of experts, the experts' weights and their adapters at the share of experts a token is sent to
    ([Note: active experts in the FLOP count])."""
    share, experts = _expert_shares(model)
    held: dict[int, tuple[torch.nn.Parameter, float]] = {}
    for path, module in model.named_modules():
        if isinstance(module, torch.nn.Embedding):
            continue
        weights = 3 if id(module) in experts else 2  # an experts module's 2-D parameters are its biases (E x out)
        for p in module.parameters(recurse=False):
            if p.dim() >= weights:
                held[id(p)] = p, next((f for prefix, f in share.items() if _under(path, prefix)), 1.0)
    trainable = sum(p.numel() * f for p, f in held.values() if p.requires_grad)
    return trainable, sum(p.numel() * f for p, f in held.values()) - trainable


# [Note: active experts in the FLOP count]
# A mixture of experts stores `E` experts per layer (transformers 5 keeps them as 3-D parameters of one experts
# module) and sends each token to `num_experts_per_tok` of them: the model FLOPs of a token are those of the router
# and its top-k experts, as benchmarks/flops.py counts them, not of every stored expert (which made the live MFU of
# Qwen3-30B-A3B 5.6x too high). PEFT's adapters on the experts (its `ParamWrapper`, wrapped around the experts
# module) hold every expert's factors too, so everything under the outermost module whose base layer is an experts
# module counts at the share top-k / E.

def _expert_shares(model: torch.nn.Module) -> tuple[dict[str, float], set[int]]:
    """Path of each outermost module holding a layer's experts (or PEFT's wrapper around them) -> the share of its
    weights one token multiplies; and the ids of the experts modules."""
    from ..compat.hf_experts import dispatching_experts

    experts = {id(module) for _, module in dispatching_experts(model)}
    if not experts:
        return {}, experts
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    top_k = getattr(text, "num_experts_per_tok", None)
    if not top_k:
        return {}, experts  # no top-k to read: every stored expert counts (an overstatement, not a guess)
    shares: dict[str, float] = {}
    for path, module in model.named_modules():
        base = module.get_base_layer() if hasattr(module, "get_base_layer") else module
        if id(base) in experts and not any(_under(path, prefix) for prefix in shares):
            stored = next((p.shape[0] for p in base.parameters(recurse=False) if p.dim() == 3), None)
            if stored:
                shares[path] = min(1.0, top_k / stored)
    return shares, experts


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + ".")


def model_training_flops_per_token(model: torch.nn.Module, seq_len: int = 0) -> float:
    """`training_flops_per_token` with the counts read from `model`, and its attention shape from its Hugging Face
    config when it has one. `seq_len=0` leaves attention out (the live metrics do: the engine counts tokens, not
    sequence lengths)."""
    trainable, frozen = _matmul_params(model)
    config = getattr(model, "config", None)
    layers = getattr(config, "num_hidden_layers", 0) or 0
    heads = getattr(config, "num_attention_heads", 0) or 0
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else 0)
    return training_flops_per_token(trainable, frozen, layers, heads * head_dim, seq_len)
