"""The runtime's shape (issues 25 and 33): its sub-packages import only downwards in the order `runtime.LAYERS`
declares, no runtime files import each other in a circle, code outside a sub-package imports only the modules its
`__all__` names, and the engine is built with its collaborators, none of them wired afterwards by setting its
attributes from outside. The imports are read from the code (every import statement, those inside functions and
under `TYPE_CHECKING` included)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

from accelerate_roundpipe.runtime import LAYERS

PACKAGE = Path(__file__).resolve().parents[1] / "accelerate_roundpipe"
RUNTIME = PACKAGE / "runtime"


def _module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_modules(path: Path, modules: set[str], package_root: Path = PACKAGE) -> set[str]:
    """The package's modules `path` imports: `from .x import y` names module `x.y` where that is a module, else `x`."""
    own = _module_name(path, package_root)
    package = own if path.name == "__init__.py" else own.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            base = ".".join(p for p in (base if node.level else "", node.module or "") if p)
            named = {f"{base}.{alias.name}" for alias in node.names}
            found.update(named & modules)
            if named - modules:  # names defined in `base` itself (`from .x import y` where y is no module)
                found.add(base)
    return {name for name in found if name in modules and name != own}


def _import_graph(root: Path, package_root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the modules under `root` it imports (packages' `__init__` included as modules)."""
    paths = sorted(root.rglob("*.py"))
    modules = {_module_name(path, package_root) for path in paths}
    return {_module_name(path, package_root): _imported_modules(path, modules, package_root) for path in paths}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of two or more modules (Tarjan), each sorted: the import circles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in sorted(graph[module]):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            group = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                group.append(top)
                if top == module:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def _upward_imports(graph: dict[str, set[str]], layers: tuple[str, ...]) -> list[str]:
    """Imports from a runtime sub-package into one after it in `layers` (or of a file outside every sub-package)."""
    rank = {name: i for i, name in enumerate(layers)}

    def layer(module: str) -> int | None:
        parts = module.split(".")
        return rank.get(parts[2], -1) if len(parts) > 2 else None  # `accelerate_roundpipe.runtime` itself: the top

    found = []
    for module, imported in sorted(graph.items()):
        own = layer(module)
        if own is None:
            continue
        for other in sorted(imported):
            theirs = layer(other)
            if own == -1 or theirs is None or theirs == -1 or theirs > own:
                found.append(f"{module} imports {other}")
    return found


def test_every_runtime_sub_package_is_in_the_declared_order_and_every_runtime_file_in_one():
    packages = sorted(path.name for path in RUNTIME.iterdir() if (path / "__init__.py").exists())
    assert sorted(LAYERS) == packages, f"runtime.LAYERS {LAYERS} against the sub-packages {packages}"
    loose = sorted(path.name for path in RUNTIME.glob("*.py") if path.name != "__init__.py")
    assert not loose, f"runtime files outside a sub-package: {loose}"


def test_no_runtime_files_import_each_other_in_a_circle():
    circles = _circles(_import_graph(RUNTIME))
    assert not circles, f"import circles among runtime files (a lazy import inside a function counts): {circles}"


def test_no_runtime_sub_package_imports_one_above_it():
    upward = _upward_imports(_import_graph(RUNTIME), LAYERS)
    assert not upward, f"imports upward through runtime.LAYERS {LAYERS}: {upward}"


def _outside_the_surface(graph: dict[str, set[str]], surface: dict[str, list[str]]) -> list[str]:
    """Imports of a sub-package's module that its `__all__` (`surface`) does not name, from outside that sub-package
    (the package itself, e.g. `from ..disk import DiskStaging`, is always its surface)."""
    found = []
    for module, imported in sorted(graph.items()):
        for other in sorted(imported):
            parts = other.split(".")
            home = ".".join(parts[:3])
            if len(parts) < 4 or parts[1] != "runtime" or module == home or module.startswith(home + "."):
                continue
            if parts[3] not in surface[parts[2]]:
                found.append(f"{module} imports {other}")
    return found


def test_code_outside_a_sub_package_imports_only_the_modules_its_init_names():
    surface = {name: list(getattr(importlib.import_module(f"accelerate_roundpipe.runtime.{name}"), "__all__", []))
               for name in LAYERS}
    outside = _outside_the_surface(_import_graph(PACKAGE), surface)
    assert not outside, f"imports of runtime modules their sub-package's __all__ does not name: {outside}"


def test_the_rules_find_what_they_look_for():
    """The checks themselves: a circle through a function-level import, an import upward, an unknown package."""
    graph = {"accelerate_roundpipe.runtime.a.x": {"accelerate_roundpipe.runtime.b.y"},
             "accelerate_roundpipe.runtime.b.y": {"accelerate_roundpipe.runtime.a.x"},
             "accelerate_roundpipe.runtime.c.z": set()}
    assert _circles(graph) == [["accelerate_roundpipe.runtime.a.x", "accelerate_roundpipe.runtime.b.y"]]
    assert _upward_imports(graph, ("a", "b", "c")) == ["accelerate_roundpipe.runtime.a.x imports "
                                                       "accelerate_roundpipe.runtime.b.y"]
    graph["accelerate_roundpipe.runtime.b.y"] = {"accelerate_roundpipe.runtime.d.w"}
    assert _upward_imports(graph, ("a", "b", "c")) == [
        "accelerate_roundpipe.runtime.a.x imports accelerate_roundpipe.runtime.b.y",
        "accelerate_roundpipe.runtime.b.y imports accelerate_roundpipe.runtime.d.w"]
    graph = {"accelerate_roundpipe.models.m": {"accelerate_roundpipe.runtime.a.x", "accelerate_roundpipe.runtime.a"},
             "accelerate_roundpipe.runtime.a.x": {"accelerate_roundpipe.runtime.a.private"},
             "accelerate_roundpipe.runtime.b.y": {"accelerate_roundpipe.runtime.a.private"}}
    assert _outside_the_surface(graph, {"a": ["x"], "b": []}) == [
        "accelerate_roundpipe.runtime.b.y imports accelerate_roundpipe.runtime.a.private"]


def test_imports_are_read_from_every_statement(tmp_path):
    """Relative and absolute, at module level, under `TYPE_CHECKING` and inside functions; `from . import y` is an
    import of module `y`, not of the package (which would make every package with a re-export a false circle)."""
    root = tmp_path / "accelerate_roundpipe" / "runtime" / "a"
    root.mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "x.py").write_text("if TYPE_CHECKING:\n    from .y import Y\ndef f():\n    from ..b import z\n"
                               "import accelerate_roundpipe.runtime.a.w\nfrom ..b import B\nfrom . import v\n")
    modules = {"accelerate_roundpipe.runtime.a.y", "accelerate_roundpipe.runtime.b.z",
               "accelerate_roundpipe.runtime.a.w", "accelerate_roundpipe.runtime.b", "accelerate_roundpipe.runtime.a.v"}
    known = modules | {"accelerate_roundpipe.runtime.a"}
    assert _imported_modules(root / "x.py", known, tmp_path / "accelerate_roundpipe") == modules


def _assignments_onto_other_objects(path: Path) -> list[str]:
    """`a.b.c = ...` or `x.c = ...` where `x` is not `self`/`cls`: an attribute of another object set from here."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
            if isinstance(node, ast.AugAssign | ast.AnnAssign) else []
        flat = []
        for target in targets:  # `a.x, b.y = ...` sets both
            flat.extend(target.elts if isinstance(target, ast.Tuple | ast.List) else [target])
        for target in flat:
            if not isinstance(target, ast.Attribute):
                continue
            owner = target.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls", "ctx") or target.attr.startswith("__"):
                continue  # its own attributes; an exception's `__cause__`
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(target)}")
    return found


def test_the_engine_and_its_dispatch_set_no_attribute_of_a_collaborator():
    """Before: `self._torn.write_back = ...`, `self._background.optimizer = ...`, `self._dispatch.next_device = ...`,
    `self.optimizer.steps_taken = ...`, `self._deferred.expected_scale = ...`, `worker.schedules = ...`,
    `worker.base_seed = ...`, `state.keep_limit_bytes = ...` (and the pass's state patched by everyone)."""
    files = ["engine/engine.py", "engine/engine_parts.py", "engine/engine_threads.py", "engine/engine_checkpoint.py",
             "engine/pass_launch.py", "execution/dispatch.py", "execution/worker.py", "state/placement.py",
             "optimizer/step_policy.py", "execution/grad_commit.py"]
    missing = [name for name in files if not (RUNTIME / name).exists()]
    assert not missing, f"renamed or removed: {missing}; name the file that took their job"
    found = [line for name in files for line in _assignments_onto_other_objects(RUNTIME / name)]
    assert not found, "attributes of other objects set from outside them (make them constructor arguments or a " \
                      f"method of their owner): {found}"
