"""How RoundPipe's command lines refuse what they are given: one line, `prog: error: message`, on stderr and exit
status 2, as argparse refuses a bad flag. No traceback: the message already says which setting, where it was given
and what it must be ([Note: settings checked where given]); the frames would only show RoundPipe's own checks.

`accelerate-roundpipe` (every subcommand) and `python -m accelerate_roundpipe.run` turn a `SettingError` into this.
The Python API (`RoundPipeConfig`, `RoundPipePlugin`, `RoundPipeTrainingArguments`, `config_command`, `run_script`)
keeps raising it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from ..config import SettingError


class CommandLineError(SystemExit):
    """A refused command line: exit status 2, and the line that was printed as the exception's text (for callers
    that run a command in-process, such as tests)."""

    def __init__(self, line: str) -> None:
        super().__init__(2)
        self.line = line

    def __str__(self) -> str:
        return self.line


def refuse(prog: str, message: str) -> CommandLineError:
    """Print `prog: error: message` and return the exit to raise (`raise refuse(...) from None`)."""
    line = f"{prog}: error: {' '.join(message.split())}"  # one line, whatever the message's own line breaks
    print(line, file=sys.stderr)
    return CommandLineError(line)


@contextlib.contextmanager
def settings_refused_as(prog: str) -> Iterator[None]:
    """Inside: a `SettingError` exits as `prog: error: ...` with status 2."""
    try:
        yield
    except SettingError as error:
        raise refuse(prog, str(error)) from None
