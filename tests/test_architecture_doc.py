"""docs/architecture.md lists every module of the package, one line each, and nothing that is not a module."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "accelerate_roundpipe"
DOC = ROOT / "docs" / "architecture.md"


def _listed_modules() -> list[str]:
    text = DOC.read_text()
    section = text.split("## Modules, one line each", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([^`]+\.py)` \|", section, flags=re.MULTILINE)


def test_every_module_is_listed_once_and_every_listed_module_exists():
    listed = _listed_modules()
    modules = sorted(str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py"))
    missing = sorted(set(modules) - set(listed))
    gone = sorted(set(listed) - set(modules))
    twice = sorted({name for name in listed if listed.count(name) > 1})
    assert not missing, f"modules missing from the table in {DOC.name}: {missing}"
    assert not gone, f"{DOC.name} lists modules that do not exist: {gone}"
    assert not twice, f"{DOC.name} lists these modules more than once: {twice}"
