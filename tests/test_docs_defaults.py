"""Every default the docs state is `RoundPipeConfig`'s own: the configuration table, the fields' help texts and
docstring, and any sentence of README.md or docs/ that gives a field's default as `field=value`.

A field whose default is one value (not "every visible GPU", "planned", ...) is resolved from a bare
`RoundPipeConfig()` (no `ROUNDPIPE_*` variable set) through its `resolved_*` property, the one place the engine
reads it from; the docs must say that value.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from accelerate_roundpipe import RoundPipeConfig
from accelerate_roundpipe.config import ENV_PREFIX

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FIELDS = [f.name for f in dataclasses.fields(RoundPipeConfig)]
# Fields whose default is one value, and how the engine resolves it from a bare config.
SINGLE_VALUE_DEFAULTS = {
    "async_optimizer": lambda c: c.resolved_async_optimizer,
    "async_warmup_steps": lambda c: c.resolved_async_warmup_steps,
    "recompute": lambda c: c.resolved_recompute,
    "wait_timeout_s": lambda c: c.resolved_wait_timeout_s,
    "summary": lambda c: c.resolved_summary,
    "kernels": lambda c: c.resolved_kernels,
    "head_shards": lambda c: c.resolved_head_shards,
    "trace_path": lambda c: c.trace_path,
    "mlp_chunk_tokens": lambda c: c.mlp_chunk_tokens,
    "peak_tflops": lambda c: c.peak_tflops,
}
NOTHING = ("off", "unknown", "none", "no recording")  # how the docs say a default of None


@pytest.fixture
def bare_config(monkeypatch) -> RoundPipeConfig:
    import os

    for name in list(os.environ):
        if name.startswith(ENV_PREFIX):
            monkeypatch.delenv(name)
    return RoundPipeConfig()


def _same(stated: str, value) -> bool:
    """Whether a default as the docs write it (`false`, 600, 'stage', off) is `value`."""
    text = stated.strip().strip("`'\" ").lower()
    text = re.sub(r"\s*\(.*\)$", "", text).strip().rstrip(".").strip("`'\" ")
    if value is None:
        return text in NOTHING
    if isinstance(value, bool):
        return text == str(value).lower()
    if isinstance(value, (int, float)):
        try:
            return float(text) == float(value)
        except ValueError:
            return False
    return text == str(value).lower()


def _configuration_table() -> dict[str, str]:
    """field -> the default column of docs/configuration.md's table."""
    rows = {}
    for line in (ROOT / "docs" / "configuration.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and re.fullmatch(r"`\w+`", cells[0]):
            rows[cells[0].strip("`")] = cells[2]
    return rows


def test_the_configuration_table_lists_every_field():
    assert sorted(_configuration_table()) == sorted(FIELDS)


@pytest.mark.parametrize("field", sorted(SINGLE_VALUE_DEFAULTS))
def test_the_configuration_table_states_the_configs_default(field, bare_config):
    value = SINGLE_VALUE_DEFAULTS[field](bare_config)
    stated = _configuration_table()[field]
    assert _same(stated, value), f"docs/configuration.md says {field} defaults to {stated}; the config: {value!r}"


@pytest.mark.parametrize("field", sorted(SINGLE_VALUE_DEFAULTS))
def test_the_help_text_and_docstring_state_the_configs_default(field, bare_config):
    value = SINGLE_VALUE_DEFAULTS[field](bare_config)
    help_text = next(f.metadata["help"] for f in dataclasses.fields(RoundPipeConfig) if f.name == field)
    stated = re.search(r"Default: ([^.;,]+)", help_text)
    assert stated is None or _same(stated.group(1), value), f"{field}'s help says {stated.group(1)!r}: {value!r}"
    doc = re.search(rf"^ {{8}}{field} \(.*?(?=^ {{8}}\w+ \(|\Z)", RoundPipeConfig.__doc__, re.MULTILINE | re.DOTALL)
    stated = re.search(r"Default: ([^.;:,]+)", doc.group(0).replace("\n", " ")) if doc else None
    assert stated is None or _same(stated.group(1), value), f"{field}'s docstring: {stated.group(1)!r}: {value!r}"


# `field=value` (or ROUNDPIPE_FIELD=value, roundpipe_field=value) called the default in the same clause, either way
# round: "`async_optimizer=True`, today's default", "the default (`async_optimizer=False`)".
VALUE_THEN_DEFAULT = re.compile(r"`(?:roundpipe_|ROUNDPIPE_)?(\w+)=([^`]+)`([^.;:()`]{0,40}?\(?[^.;:()`]{0,40}?)"
                                r"\bdefault\b(?! is)")
DEFAULT_THEN_VALUE = re.compile(r"\bdefault\b[^.;:`]{0,12}?\(?`(?:roundpipe_|ROUNDPIPE_)?(\w+)=([^`]+)`")
# The step mode in words: the lagged step is not the default.
LAGGED_BY_DEFAULT = re.compile(r"(one (iteration|step) late|lagged|staleness[- ]1|async)[^.;:]{0,30}\bby default"
                               r"|\bdefault\b(\s+is|:)?\s*\(?(the\s+)?(lagged|one (iteration|step) late|async\b)",
                               re.IGNORECASE)
PLACEHOLDER = re.compile(r"[A-Z]")  # `head_shards=K`: a value for the reader to pick, not a stated default


def _sentences(page: Path):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)  # code blocks state no defaults
    for paragraph in re.split(r"\n\s*\n", text):
        yield from re.split(r"(?<=[.!?])\s+(?=[A-Z*`(\[])", " ".join(paragraph.split()))


def test_every_default_stated_in_the_docs_is_the_configs(bare_config):
    wrong = []
    for page in PAGES:
        for sentence in _sentences(page):
            found = [(m.group(1), m.group(2)) for m in VALUE_THEN_DEFAULT.finditer(sentence)]
            found += [(m.group(1), m.group(2)) for m in DEFAULT_THEN_VALUE.finditer(sentence)]
            for name, stated in found:
                name = name.lower()
                if PLACEHOLDER.fullmatch(stated) or name not in SINGLE_VALUE_DEFAULTS:
                    continue
                if not _same(stated, SINGLE_VALUE_DEFAULTS[name](bare_config)):
                    wrong.append(f"{page.relative_to(ROOT)}: {name}={stated} called the default: {sentence!r}")
            if bare_config.resolved_async_optimizer is False and LAGGED_BY_DEFAULT.search(sentence):
                wrong.append(f"{page.relative_to(ROOT)}: the lagged step called the default: {sentence!r}")
    assert not wrong, "\n".join(wrong)
