"""[Note: short batches]
The engine treats an explicit `num_microbatches` larger than a training batch as an error (silently running fewer
micro-batches than asked would hide a configuration mistake). Stock loops and the Trainer keep the last, shorter
batch of every epoch (`drop_last=False`), so an 8-micro-batch run would stop at the first epoch end with a 5-row
batch. For the models it prepares, the integration lowers the count to the batch's rows for such a batch, once per
call, and says so once per engine; every other batch runs with the configured count.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref

import torch

from ..runtime import RoundPipe

logger = logging.getLogger(__name__)

_BATCH_KEYS = ("input_ids", "inputs_embeds", "labels", "attention_mask")


def batch_rows(args: tuple, kwargs: dict) -> int | None:
    """Rows of a batch given as positional tensors (`nn.Sequential` engines) or HF keyword arguments."""
    for value in [*args, *(kwargs.get(k) for k in _BATCH_KEYS)]:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value.shape[0]
    return None


@contextlib.contextmanager
def microbatches_for(engine: RoundPipe, rows: int | None):
    """Run one call with at most `rows` micro-batches (see [Note: short batches])."""
    requested = engine.config.num_microbatches
    if requested is None or rows is None or rows < 1 or rows >= requested:
        yield
        return
    if not getattr(engine, "_roundpipe_warned_short_batch", False):
        logger.warning("A batch of %d rows is shorter than num_microbatches=%d (ROUNDPIPE_NUM_MICROBATCHES); running "
                       "it as %d micro-batches (typically the last batch of an epoch). Shown once.", rows, requested,
                       rows)
        object.__setattr__(engine, "_roundpipe_warned_short_batch", True)
    engine.config.num_microbatches = rows
    try:
        yield
    finally:
        engine.config.num_microbatches = requested


def allow_short_batches(engine: RoundPipe) -> None:
    """Make `engine.forward_backward` (also what the patched HF forward calls) follow short batches."""
    original = engine.forward_backward
    engine_ref = weakref.ref(engine)

    @functools.wraps(original)
    def forward_backward(*args, **kwargs):
        with microbatches_for(engine_ref(), batch_rows(args, kwargs)):
            return original(*args, **kwargs)

    object.__setattr__(engine, "forward_backward", forward_backward)
