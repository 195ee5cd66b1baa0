"""The interpreter's thread switch interval while an engine drives GPUs.

[Note: GIL switch interval]
An engine's host work runs on several Python threads at once: the caller (a Trainer's loop, its data collator, its
logging), one worker per device issuing each task's layers, a commit thread per worker and the optimizer thread.
Every torch call releases the GIL and takes it back; when another thread is running Python meanwhile, taking it back
waits until that thread lets go, which CPython asks of it only after the switch interval (`sys.getswitchinterval()`,
5 ms by default). A trace of the 168M convergence preset on one H200, every optimizer step on the GPU, showed device
steps of 0.1 ms of kernels taking 5-14 ms each between two iterations while the caller and the worker ran Python:
the GPU waited on the GIL, not on work. A shorter interval bounds each such wait. RoundPipe sets it when an engine
on a GPU is built, unless it was changed from CPython's default (a value you set stands: set it before building the
engine, e.g. `sys.setswitchinterval(0.005)` keeps the default's behaviour). The setting is process-wide, like the
allocator setting of `device.use_expandable_segments`, and said so in the log.
"""

from __future__ import annotations

import sys

CPYTHON_DEFAULT_S = 0.005
SWITCH_INTERVAL_S = 0.001


def use_short_switch_interval() -> bool:
    """Set the switch interval to `SWITCH_INTERVAL_S` if it is still CPython's default; True if it was set."""
    if sys.getswitchinterval() != CPYTHON_DEFAULT_S:
        return False
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    return True
