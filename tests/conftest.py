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
