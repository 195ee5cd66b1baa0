"""A one-process gloo group for the tests of what RoundPipe does to torch's default process group, whether or not
another test in this process left a group up."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# The group's timeout as torch's gloo backend holds it, in seconds, before and after the call.
_TIMEOUT_AROUND = """
import datetime

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from accelerate_roundpipe.compat import torch_internals
from accelerate_roundpipe.integrations import multi_process

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
try:
    backend = c10d._get_default_group()._get_backend(torch.device("cpu"))
    before = backend.options._timeout.total_seconds()
    {call}
    print(before, backend.options._timeout.total_seconds())
finally:
    dist.destroy_process_group()
"""


def default_group_timeout_around(call: str) -> tuple[float, float]:
    """Run `call` (one line of Python; `datetime`, `torch_internals` and `multi_process` are imported) with a fresh
    one-process gloo group as the default group, in a fresh interpreter: a group another test left up in this
    process is neither in the way nor changed. Returns the group's timeout in seconds before and after `call`."""
    result = subprocess.run([sys.executable, "-c", _TIMEOUT_AROUND.format(call=call)], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    before, after = result.stdout.split()[-2:]
    return float(before), float(after)


@contextlib.contextmanager
def default_group_up() -> Iterator[None]:
    """A default process group for the duration: the one already up (left as it is), else a one-process gloo group
    brought up here and destroyed after. For calls that must be refused before they change the group."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
