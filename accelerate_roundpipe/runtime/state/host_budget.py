"""Will the host store fit in host memory? A warning before the OS's out-of-memory killer answers instead.

RoundPipe keeps everything on the host: for each trainable parameter the compute copy, the optimizer copy, the
gradient buffer and, with AdamW (the usual choice; the optimizer is not known when the store is built), two optimizer
states; frozen parameters keep the compute copy only. A bucket holds its gradient buffer only while it holds
gradients and there is no spare beside it ([Note: no spare gradient buffer]); every bucket's is counted, as a clip or
accumulation across calls holds them all until the step (without either, the buckets already stepped hold none:
[Note: zeroing as each bucket is stepped]). The model's own parameters are freed as the store takes them over, so
they count as available.
"""

from __future__ import annotations

import logging

import torch

from ..disk import available_memory_bytes

logger = logging.getLogger(__name__)

OPTIMIZER_STATES = 2  # AdamW's exp_avg and exp_avg_sq
HEADROOM = 0.9  # share of the available memory the store may take before we warn (activations need the rest)


def store_bytes(params: list[tuple[int, torch.dtype, bool]], optimizer_dtype_of) -> int:
    """Host bytes of the store for (numel, compute dtype, trainable) entries; `optimizer_dtype_of(compute dtype)`."""
    total = 0
    for numel, dtype, trainable in params:
        total += numel * dtype.itemsize
        if trainable:
            # the optimizer copy, the gradient and the optimizer states
            total += numel * optimizer_dtype_of(dtype).itemsize * (2 + OPTIMIZER_STATES)
    return total


def available_bytes() -> int | None:
    """The host memory available now: the same measurement as the disk tier's default budget (MemAvailable, capped
    by a container's memory limit: [Note: default host memory budget]), so the warning and the budget agree."""
    return available_memory_bytes()


def warn_if_short(needed: int, freed: int, available: int | None = None) -> str | None:
    """Log (and return) a warning when `needed` bytes exceed HEADROOM of what is available plus `freed`."""
    available = available_bytes() if available is None else available
    if available is None or needed <= HEADROOM * (available + freed):
        return None
    message = (f"RoundPipe's host store needs about {needed / 2**30:.1f} GiB (compute copies, optimizer copies, "
               f"gradients, AdamW state) and this machine has about {(available + freed) / 2**30:.1f}"
               f" GiB available. When the optimizer is wrapped, the optimizer copies and states past "
               f"host_memory_budget (default: the memory available less 20%) go to swap files under offload_dir "
               f"(the start summary's tiers line says how many); what must stay (compute copies, gradients, "
               f"activations) may still not fit. Train fewer parameters (LoRA: frozen weights keep one copy), a "
               f"smaller model, or free host memory.")
    logger.warning(message)
    return message
