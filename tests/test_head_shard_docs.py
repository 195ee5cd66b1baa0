"""What `head_shards` uploads, said the same in `RoundPipeConfig`'s docstring, docs/configuration.md and
docs/how-it-works.md: each shard's task uploads only its rows of the lm_head weight and downloads only their gradient
([Note: row windows] in runtime/state/host_store.py; measured by tests/models/test_vocab_shards.py::
test_each_shard_moves_only_its_rows)."""

from __future__ import annotations

import re
from pathlib import Path

from accelerate_roundpipe import RoundPipeConfig

ROOT = Path(__file__).resolve().parent.parent


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def _docstring_entry(name: str) -> str:
    doc = RoundPipeConfig.__doc__
    start = doc.index(f"        {name} (")
    end = re.compile(r"\n        \w+ \(").search(doc, start + 1).start()
    return _flat(doc[start:end])


def test_the_docstring_says_each_shard_uploads_only_its_rows():
    """Before: "Each shard still uploads the whole head weight (the host store has no row-range buckets yet)"."""
    entry = _docstring_entry("head_shards")
    assert "whole head weight" not in entry, entry
    assert "each shard uploads only its rows of the head weight" in entry.lower(), entry


def test_the_docs_say_it_too():
    configuration = _flat((ROOT / "docs" / "configuration.md").read_text())
    assert "each shard uploads only its rows of the head weight" in configuration
    how = _flat((ROOT / "docs" / "how-it-works.md").read_text())
    assert "Each shard's task uploads only its rows of the lm_head" in how
    for text in (configuration, how):
        assert "whole head weight" not in text
