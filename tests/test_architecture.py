"""Rules of the package's layout that a reader relies on (docs/architecture.md)."""

from __future__ import annotations

import ast
import io
import tokenize
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


# -- size: no function over 60 code lines, no module over 400 (issue 33, item 7) --------------
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 400

# Modules and functions (`module:qualname`) still over a limit, each with its count when it was
# listed: a ceiling that may only go down. An entry leaves once its code is under the limit or
# gone (test_the_size_allow_list_is_current), and nothing new joins the list. solver.py and
# stages.py are taken apart by the core/exec split (issue 33).
OVER_THE_LIMIT = {
    "aadl_func._src.solver": 720,
    "aadl_func._src.stages": 589,
}


def code_lines(source: str) -> set[int]:
    """The numbers of the lines of `source` that hold code: a token other than a comment or a
    docstring (the first statement of a module, class or function, when it is a string);
    blank lines and lines that only continue a docstring do not count."""
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    layout = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in layout or token.type == tokenize.ENDMARKER:
            continue
        # A token over several lines (a string that is not a docstring) counts on each.
        lines.update(range(token.start[0], token.end[0] + 1))
    return lines - docstrings


def sizes(source: str, module: str) -> dict[str, int]:
    """Code lines of the module (under its name) and of each function in it (as
    `module:qualname`, methods and nested functions included; a nested function's lines count
    for the function around it too), decorators included."""
    lines = code_lines(source)
    found = {module: len(lines)}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}.{child.name}" if prefix else f"{module}:{child.name}"
                if not isinstance(child, ast.ClassDef):
                    start = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                    found[name] = len([n for n in lines if start <= n <= child.end_lineno])
                visit(child, name)
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def _limit(name: str) -> int:
    return MAX_FUNCTION_LINES if ":" in name else MAX_MODULE_LINES


def _package_sizes() -> dict[str, int]:
    found: dict[str, int] = {}
    for path in PACKAGE.rglob("*.py"):
        found.update(sizes(path.read_text(), _module_name(path)))
    return found


def test_no_function_or_module_over_the_size_limits():
    found = _package_sizes()
    assert sum(":" not in name for name in found) > 30 and len(found) > 500  # the scan worked
    over = {name: n for name, n in found.items() if n > _limit(name)}
    new = {name: n for name, n in over.items() if name not in OVER_THE_LIMIT}
    assert new == {}, (
        f"over {MAX_FUNCTION_LINES} code lines in a function or {MAX_MODULE_LINES} in a module: "
        "split it along its jobs (docstrings and comments do not count)"
    )
    grown = {
        name: (n, OVER_THE_LIMIT[name]) for name, n in over.items() if n > OVER_THE_LIMIT[name]
    }
    assert grown == {}, "(now, ceiling): an allowed offender grew; its ceiling only goes down"


def test_the_size_allow_list_is_current():
    """An entry whose code is gone or under its limit leaves the list, so that it cannot grow
    back unnoticed."""
    found = _package_sizes()
    stale = [name for name in OVER_THE_LIMIT if found.get(name, 0) <= _limit(name)]
    assert stale == [], "remove these entries from OVER_THE_LIMIT"


def test_code_lines_count_code_only():
    source = '''"""Module docstring,
over two lines."""
import os  # a comment


def f(x):
    """Docstring."""
    # a comment on its own line

    y = (x +
         1)
    text = """a string
that is not a docstring"""
    return y, text


class C:
    """Class docstring."""

    @staticmethod
    def g():
        def inner():
            return 1
        return inner
'''
    assert sorted(code_lines(source)) == [3, 6, 10, 11, 12, 13, 14, 17, 20, 21, 22, 23, 24]
    assert sizes(source, "m") == {"m": 13, "m:f": 6, "m:C.g": 5, "m:C.g.inner": 2}
