"""Integration tests run offline, on CPU workers, one intra-op thread (see `roundpipe_testing.py`)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest

# Stock scripts call `datasets.load_dataset("text", ...)` on local files; never let them reach for the Hub.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


PREFIX = "roundpipe_tests_hf_home_"


def _private_home() -> str:
    """The suite never reads the user's settings: not the accelerate config `accelerate-roundpipe config` writes to
    ~/.cache/huggingface/accelerate/ (`launch` reads it by default), not the ROUNDPIPE_* variables the user exported.
    Set at import, before any test module imports accelerate (which fixes its config paths from HF_HOME then), and
    in os.environ, so every subprocess a test starts inherits it. tests/ and integration_tests/ share one."""
    home = os.environ.get("HF_HOME", "")
    if not (os.path.basename(home).startswith(PREFIX) and os.path.isdir(home)):  # not the other conftest's already
        home = tempfile.mkdtemp(prefix=PREFIX)
        atexit.register(shutil.rmtree, home, ignore_errors=True)
    os.environ["HF_HOME"] = home
    os.environ.pop("XDG_CACHE_HOME", None)
    for name in [name for name in os.environ if name.startswith("ROUNDPIPE_")]:
        del os.environ[name]
    return home


HF_HOME = _private_home()


@pytest.fixture(autouse=True)
def private_hf_home():
    """Each test starts in the suite's own HF home with no ROUNDPIPE_* variable, and a config a test wrote there
    (`accelerate-roundpipe config` without --config_file) is gone before the next."""
    os.environ["HF_HOME"] = HF_HOME
    for name in [name for name in os.environ if name.startswith("ROUNDPIPE_")]:
        del os.environ[name]
    yield
    shutil.rmtree(os.path.join(HF_HOME, "accelerate"), ignore_errors=True)


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
