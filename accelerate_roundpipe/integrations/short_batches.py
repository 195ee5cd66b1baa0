"""[Note: short batches]
The engine treats an explicit `num_microbatches` larger than a training batch as an error (silently running fewer
micro-batches than asked would hide a configuration mistake). Stock loops and the Trainer keep the last, shorter
batch of every epoch (`drop_last=False`), so an 8-micro-batch run would stop at the first epoch end with a 5-row
batch. For the models it prepares, the integration sets the engine's `allow_short_batches`: such a batch then runs
with as many micro-batches as it has rows, with one warning per engine; every other batch runs with the configured
count.
"""

from __future__ import annotations

from ..runtime import RoundPipe


def allow_short_batches(engine: RoundPipe) -> None:
    engine.allow_short_batches = True
