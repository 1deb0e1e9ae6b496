"""Rules of the package's layout that a reader relies on (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import aadl_func

PACKAGE = Path(aadl_func.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(path: Path, modules: set[str]) -> set[str]:
    """The package modules `path` imports when it is imported: top-level imports, not those
    under `if TYPE_CHECKING:` nor inside functions or classes (which run later)."""
    found: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for item in ast.walk(node):
            if isinstance(item, ast.ImportFrom) and item.module and item.level == 0:
                # `from package import module` imports the module too.
                candidates = [item.module, *(f"{item.module}.{a.name}" for a in item.names)]
                found.update(c for c in candidates if c in modules)
            elif isinstance(item, ast.Import):
                found.update(a.name for a in item.names if a.name in modules)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every elementary cycle's nodes, found by a depth-first search from each module."""
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(graph[node]):
            if nxt == path[0]:
                cycles.append(path)
            elif nxt not in path and nxt > path[0]:  # each cycle once, from its least module
                visit(nxt, [*path, nxt])

    for start in sorted(graph):
        visit(start, [start])
    return cycles


def test_no_runtime_import_cycles():
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: _runtime_imports(path, set(files)) - {name} for name, path in files.items()}
    # The package's own __init__ imports everything; the cycles that matter are below it.
    graph = {k: v - {"aadl_func"} for k, v in graph.items() if k != "aadl_func"}
    assert len(graph) > 30  # the scan found the modules
    assert any(graph.values())  # and their imports
    assert _cycles(graph) == []


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
