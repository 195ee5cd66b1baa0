"""Writing the engines' timeline traces when training ends.

The ways in never call `close()`: [Note: trace at exit].
"""

from __future__ import annotations

import logging

from ..runtime import RoundPipe

logger = logging.getLogger(__name__)


def write_traces(engines: list[RoundPipe]) -> None:
    """Write the trace of every engine that records one: the whole timeline once its work is done; a failed
    engine's trace as far as it got (its error was already raised in the loop)."""
    for engine in engines:
        if engine.trace is None or engine.closed:
            continue
        try:
            engine.save_trace()
        except Exception as error:  # a failed engine: keep what it recorded, the loop saw the error itself
            logger.warning(
                "RoundPipe could not finish its work before writing the trace (%s); writing what was recorded.", error
            )
            engine.trace.save()
