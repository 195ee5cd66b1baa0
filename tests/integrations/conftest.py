"""Unit tests of `accelerate_roundpipe.integrations`: in-process, CPU workers, one intra-op thread."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def one_intra_op_thread():
    """Each CPU worker is a thread; extra intra-op threads only contend for the cores (and slow CI down)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    from accelerate_roundpipe.compat.accelerate_internals import reset_accelerate_state

    reset_accelerate_state()
    yield
    reset_accelerate_state()
