"""The whole suite (tests/ and integration_tests/) runs in an HF home of its own, with no ROUNDPIPE_* variable of
the user's: CI and a developer's machine behave alike (issue 31 item 5)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest

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
