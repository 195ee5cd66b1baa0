"""Telemetry reads the engine through types it declares (issue 33 item 1): the start summary through the engine's
snapshot (`telemetry/engine_view.py`), the live metrics through the counters, the trace and a memory gauge protocol;
no code of telemetry/ takes, holds or reads an `engine` by attribute name, every parameter of the modules that
describe the engine is annotated with a type that resolves, and telemetry imports nothing from the runtime (it sits
below it)."""

from __future__ import annotations

import ast
import importlib
import inspect
import typing
from pathlib import Path

import pytest

TELEMETRY = Path(__file__).resolve().parents[1] / "accelerate_roundpipe" / "telemetry"
TYPED = ["engine_view", "metrics", "summary"]  # the modules that describe an engine


def _engine_names(path: Path) -> list[str]:
    """Where `path`'s code names `engine`: a parameter, a variable, an attribute (`self.engine`, `x.engine`)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.arg) and node.arg == "engine" or isinstance(node, ast.Name) and node.id == "engine" \
                or isinstance(node, ast.Attribute) and node.attr == "engine":
            found.append(f"{path.name}:{node.lineno}")
    return found


def test_no_telemetry_code_takes_or_reads_an_engine():
    found = sorted({where for path in sorted(TELEMETRY.glob("*.py")) for where in _engine_names(path)})
    assert not found, f"telemetry code names an engine (read its snapshot or a typed interface instead): {found}"


def _functions(module) -> list[tuple[str, typing.Callable]]:
    """The functions and methods written in `module` (not those a dataclass generates)."""
    found = []
    for name, value in vars(module).items():
        if inspect.isfunction(value) and value.__module__ == module.__name__:
            found.append((name, value))
        elif inspect.isclass(value) and value.__module__ == module.__name__:
            found += [(f"{name}.{attr}", f) for attr, f in vars(value).items()
                      if inspect.isfunction(f) and f.__qualname__.startswith(name)]
    return [(name, f) for name, f in found if f.__code__.co_filename == module.__file__]


@pytest.mark.parametrize("name", TYPED)
def test_every_parameter_of_the_modules_that_describe_the_engine_is_typed(name):
    module = importlib.import_module(f"accelerate_roundpipe.telemetry.{name}")
    untyped = []
    for qualname, function in _functions(module):
        hints = typing.get_type_hints(function)  # raises when an annotation names nothing
        for parameter in list(inspect.signature(function).parameters)[(1 if "." in qualname else 0):]:
            if hints.get(parameter, typing.Any) in (typing.Any, object):
                untyped.append(f"{qualname}({parameter})")
    assert not untyped, f"untyped parameters (duck-typed reads) in telemetry/{name}.py: {untyped}"


def test_telemetry_imports_nothing_from_the_runtime():
    found = []
    for path in sorted(TELEMETRY.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "runtime" and node.level:
                found.append(f"{path.name}:{node.lineno}")
            elif isinstance(node, ast.Import | ast.ImportFrom) and "accelerate_roundpipe.runtime" in ast.unparse(node):
                found.append(f"{path.name}:{node.lineno}")
    assert not found, found
