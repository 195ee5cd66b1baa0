"""Note comments stay findable: every reference names exactly one definition, spelt out in full.

A note is a longer explanation written once, where the code it explains lives. Its definition is a line holding
only its title in square brackets, "Note: " then the name, opening a comment or a docstring paragraph; anywhere else
the same bracketed title is a reference to it. A reference cut short ("bounded ..." for "bounded run-ahead") or
wrapped over two lines cannot be found by grep, so the reader never reaches the explanation: both fail here.
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass, field

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCANNED = ("accelerate_roundpipe", "tests", "integration_tests", "benchmarks", "examples", "docs", "scripts",
           "README.md")
SUFFIXES = (".py", ".md", ".sh")

OPENING = re.compile(r"\[Note:")  # every mention, closed on its line or not
TITLE = re.compile(r"\[Note: ([^\]\n]+)\]")
# The title alone on its line, after a comment marker or a docstring's opening quotes.
DEFINITION = re.compile(r'^\s*(?:#\s*|[rRbBuU]?"""|[rRbBuU]?\'\'\')?\s*\[Note: ([^\]\n]+)\]\s*$')


@dataclass
class Notes:
    definitions: dict[str, list[str]] = field(default_factory=dict)  # name -> where it is defined
    references: list[tuple[str, str]] = field(default_factory=list)  # (name, where)
    unclosed: list[str] = field(default_factory=list)  # where a title does not close on its own line


def collect(text: str, where: str, notes: Notes) -> None:
    """Add the definitions and references of one file's text to `notes`."""
    for number, line in enumerate(text.splitlines(), start=1):
        place = f"{where}:{number}"
        definition = DEFINITION.match(line)
        if definition:
            notes.definitions.setdefault(definition.group(1), []).append(place)
            continue
        titles = TITLE.findall(line)
        notes.references.extend((name, place) for name in titles)
        if len(OPENING.findall(line)) > len(titles):
            notes.unclosed.append(place)


def problems(notes: Notes) -> list[str]:
    found = [f"{name!r} is defined {len(places)} times: {', '.join(places)}"
             for name, places in sorted(notes.definitions.items()) if len(places) > 1]
    found += [f"{place}: a note title that does not close on its line (write it on one line)"
              for place in notes.unclosed]
    for name, place in notes.references:
        if name not in notes.definitions:
            close = difflib.get_close_matches(name, list(notes.definitions), n=1, cutoff=0.3)
            hint = f" (write the full name: {close[0]!r}?)" if close else ""
            found.append(f"{place}: refers to {name!r}, which no note defines{hint}")
    return found


def scan_repository() -> Notes:
    notes = Notes()
    this_file = os.path.abspath(__file__)
    for root in SCANNED:
        top = os.path.join(REPO, root)
        paths = [top] if os.path.isfile(top) else sorted(
            os.path.join(folder, name) for folder, _, names in os.walk(top) for name in names)
        for path in paths:
            if path.endswith(SUFFIXES) and os.path.abspath(path) != this_file:
                with open(path, encoding="utf-8") as f:
                    collect(f.read(), os.path.relpath(path, REPO), notes)
    return notes


def test_every_note_reference_names_exactly_one_definition():
    notes = scan_repository()
    assert len(notes.definitions) >= 10, "found almost no notes: has the package moved?"
    found = problems(notes)
    if found:
        pytest.fail("\n".join(found), pytrace=False)


def test_cut_short_wrapped_and_duplicated_notes_are_reported():
    notes = Notes()
    collect('"""[Note: bounded run-ahead]\nWhy the worker waits."""\n', "worker.py", notes)
    collect("# [Note: bounded run-ahead]\n", "copy.py", notes)
    collect("x = 1  # see [Note: bounded ...]\n", "a.py", notes)
    collect("see [Note: bounded run-ahead] and [Note: bounded\nrun-ahead]\n", "b.md", notes)
    assert notes.definitions == {"bounded run-ahead": ["worker.py:1", "copy.py:1"]}
    assert problems(notes) == [
        "'bounded run-ahead' is defined 2 times: worker.py:1, copy.py:1",
        "b.md:1: a note title that does not close on its line (write it on one line)",
        "a.py:1: refers to 'bounded ...', which no note defines (write the full name: 'bounded run-ahead'?)",
    ]
