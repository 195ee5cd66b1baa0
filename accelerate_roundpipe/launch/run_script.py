"""`python -m accelerate_roundpipe.run script.py ARGS`: run a stock script with RoundPipe installed.

Also works under accelerate's launcher, which runs it as a module in the process it starts:

    accelerate launch -m accelerate_roundpipe.run script.py ARGS
    python -m accelerate_roundpipe.run -m package.module ARGS

RoundPipe's settings come from the `ROUNDPIPE_*` variables (at least `ROUNDPIPE_DEVICES`,
`ROUNDPIPE_NUM_MICROBATCHES`, `ROUNDPIPE_ASYNC_OPTIMIZER`); Trainer scripts also accept `--roundpipe_*` flags.
"""

from __future__ import annotations

import os
import runpy
import sys

from .install import installed
from .refusals import refuse, settings_refused_as

PROG = "python -m accelerate_roundpipe.run"

USAGE = """usage: python -m accelerate_roundpipe.run (script.py | -m module) [script arguments ...]

Runs a stock Accelerate or Trainer script on RoundPipe, unedited: `accelerate.Accelerator`, `transformers.Trainer`
and `transformers.TrainingArguments` become their RoundPipe versions before the script starts. Settings come from the
ROUNDPIPE_* environment variables (e.g. ROUNDPIPE_DEVICES=cuda:0,cuda:1 ROUNDPIPE_NUM_MICROBATCHES=8
ROUNDPIPE_ASYNC_OPTIMIZER=true); Trainer scripts also take --roundpipe_* flags."""


def run_script(target: list[str]) -> None:
    """Run `script.py ARGS` or `-m module ARGS` as `__main__`, with RoundPipe installed for its duration. A bad
    RoundPipe setting raises `SettingError` (a ValueError) before the script's first line, or from the script where
    it builds its settings (its `TrainingArguments`); a bad command line exits with status 2."""
    if target and target[0] in ("-h", "--help"):
        print(USAGE)
        return
    if not target:
        print(USAGE.split("\n\n")[0], file=sys.stderr)  # the usage line, as argparse prints it before the error
        raise refuse(PROG, "a script (or -m module) to run is required.")
    if target[0] in ("-m", "--module"):
        if len(target) < 2:
            raise refuse(PROG, "-m needs a module name.")
        module, script_args = target[1], target[2:]
        path = None
    else:
        path, script_args = target[0], target[1:]
        if not os.path.isfile(path):
            raise refuse(PROG, f"no such script: {path!r}.")
    saved_argv, saved_path = sys.argv, list(sys.path)
    try:
        with installed():
            if path is None:
                sys.argv = [module, *script_args]
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            else:
                sys.argv = [path, *script_args]
                sys.path.insert(0, os.path.dirname(os.path.abspath(path)))  # as `python script.py` would
                runpy.run_path(path, run_name="__main__")
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


def main(argv: list[str] | None = None) -> None:
    """The command line: a refused RoundPipe setting, given to the launcher or to the script (its --roundpipe_*
    flags), is one `python -m accelerate_roundpipe.run: error: ...` line and exit status 2."""
    with settings_refused_as(PROG):
        run_script(sys.argv[1:] if argv is None else argv)
