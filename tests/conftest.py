"""Every test gets the environment it started with back (some libraries write ACCELERATE_*/ROUNDPIPE_* variables,
e.g. transformers 4.x `TrainingArguments` with `fsdp` set, and one test's settings must not leak into the next)."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def restore_environment():
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def locks(monkeypatch):
    """Host-memory locks recorded instead of made (tests/recorded_locks.py): the page-locking tests run on CPU."""
    from recorded_locks import RecordedLocks

    from accelerate_roundpipe.runtime.devices import pinned

    recorded = RecordedLocks()
    monkeypatch.setattr(pinned, "CudaHostLocks", lambda: recorded)
    return recorded
