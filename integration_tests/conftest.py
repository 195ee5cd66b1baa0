"""Integration tests run offline, on CPU workers, one intra-op thread (see `roundpipe_testing.py`)."""

from __future__ import annotations

import os

import pytest

# Stock scripts call `datasets.load_dataset("text", ...)` on local files; never let them reach for the Hub.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(autouse=True)
def restore_environment():
    """One test's environment variables (ours, or ones libraries write, e.g. transformers 4.x `TrainingArguments`
    setting ACCELERATE_USE_FSDP) never leak into the next."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def one_intra_op_thread():
    """Each CPU worker is a thread; on a 2-core CI machine more intra-op threads only add contention (10x slower).
    Plain and RoundPipe runs use the same setting, so their numerics stay comparable."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory) -> str:
    """Tokenizer, tiny Llama config and train/validation text, laid out for the stock scripts."""
    from accelerate_roundpipe.tiny.data import write_assets

    return write_assets(str(tmp_path_factory.mktemp("tiny_assets")))
