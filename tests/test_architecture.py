"""Rules of the package's layout that a reader relies on (docs/architecture.md)."""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path
from typing import NamedTuple

import aadl_func

PACKAGE = Path(aadl_func.__file__).parent


def _module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


class Import(NamedTuple):
    """One import of a package module by another: `where` it runs is "module" (when the
    importer is imported: its top level and class bodies), "function" (when a function runs)
    or "type_checking" (never: under `if TYPE_CHECKING:`)."""

    source: str
    target: str
    where: str
    line: int


def _targets(node: ast.Import | ast.ImportFrom, source: str, is_package: bool, modules: set[str]):
    """The package modules an import statement in module `source` runs: those it names (a
    relative one resolved; `from package import module` names the module), and the packages
    above them, whose `__init__` runs first (but the root: it is the package's front, which
    imports everything, and Python has it under way before any module of the package)."""
    if isinstance(node, ast.Import):
        named = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = source.split(".") if is_package else source.split(".")[:-1]
            anchor = ".".join(package[: len(package) - node.level + 1])
            base = f"{anchor}.{base}" if base else anchor
        named = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    found = {name for name in named if name in modules}
    for name in list(found):
        parts = name.split(".")
        found.update(".".join(parts[:i]) for i in range(2, len(parts)))
    return found - {source}


def imports(path: Path, source: str, modules: set[str]) -> list[Import]:
    """Every import of a package module in the file `path` (module `source`), marked with
    where it runs."""
    is_package = path.name == "__init__.py"
    found: list[Import] = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, "function" if where == "module" else where)
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for branch, kind in ((child.body, "type_checking"), (child.orelse, where)):
                    for statement in branch:
                        visit(ast.Module(body=[statement], type_ignores=[]), kind)
            elif isinstance(child, (ast.Import, ast.ImportFrom)):
                for target in _targets(child, source, is_package, modules):
                    found.append(Import(source, target, where, child.lineno))
            else:
                visit(child, where)

    visit(ast.parse(path.read_text()), "module")
    return found


def import_graph(package: Path) -> list[Import]:
    """The imports between the modules of the package at `package`, read with `ast`."""
    files = {_module_name(p, package): p for p in package.rglob("*.py")}
    return [edge for name, path in files.items() for edge in imports(path, name, set(files))]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every elementary cycle's nodes, found by a depth-first search from each module."""
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt == path[0]:
                cycles.append(path)
            elif nxt not in path and nxt > path[0]:  # each cycle once, from its least module
                visit(nxt, [*path, nxt])

    for start in sorted(graph):
        visit(start, [start])
    return cycles


def cycles_through(edges: list[Import], kinds: set[str]) -> list[list[str]]:
    """The cycles of the imports that run `where` one of `kinds`."""
    graph: dict[str, set[str]] = {}
    for edge in edges:
        if edge.where in kinds:
            graph.setdefault(edge.source, set()).add(edge.target)
    return _cycles(graph)


def test_no_runtime_import_cycles():
    """A cycle among top-level imports works only in some import orders: break it by moving
    the function that closes it (an import for annotations only goes under TYPE_CHECKING)."""
    edges = import_graph(PACKAGE)
    assert len({e.source for e in edges}) > 30  # the scan found the modules and their imports
    assert cycles_through(edges, {"module"}) == []


def test_no_import_in_a_function_hides_a_cycle():
    """An import moved into a function does not break a cycle, it defers it: the function's
    imports close no cycle with the top-level ones either."""
    edges = import_graph(PACKAGE)
    hidden = cycles_through(edges, {"module", "function"})
    inside = [f"{e.source}:{e.line} -> {e.target}" for e in edges if e.where == "function"]
    assert hidden == [], f"imports inside functions: {inside}"


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_import_graph_marks_where_each_import_runs(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from pkg.a import f\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "c.py").write_text("from .. import b\n")
    (package / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "import pkg.sub.c\n"
        "if TYPE_CHECKING:\n    from pkg import b\n"
        "class K:\n    from pkg.sub import c\n"
        "def f():\n    from . import b\n"
    )
    (package / "b.py").write_text("from pkg.a import f\n")
    (package / "d.py").write_text("from pkg import f\n")  # a name from the root
    edges = {(e.source, e.target, e.where, e.line) for e in import_graph(package)}
    assert edges == {
        ("pkg", "pkg.a", "module", 1),
        ("pkg.sub.c", "pkg.b", "module", 1),
        ("pkg.a", "pkg.sub.c", "module", 2),
        ("pkg.a", "pkg.sub", "module", 2),  # the package above runs first
        ("pkg.a", "pkg.b", "type_checking", 4),
        ("pkg.a", "pkg.sub.c", "module", 6),  # a class body runs on import
        ("pkg.a", "pkg.sub", "module", 6),
        ("pkg.a", "pkg.b", "function", 8),
        ("pkg.b", "pkg.a", "module", 1),
        ("pkg.d", "pkg", "module", 1),
    }
    edges = import_graph(package)
    assert cycles_through(edges, {"module"}) == [["pkg.a", "pkg.sub.c", "pkg.b"]]
    assert cycles_through(edges, {"module", "function"}) == [
        ["pkg.a", "pkg.b"],
        ["pkg.a", "pkg.sub.c", "pkg.b"],
    ]


# -- size: no function over 60 code lines, no module over 400 (issue 33, item 7) --------------
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 400

# Modules and functions (`module:qualname`) still over a limit, each with its count when it was
# listed: a ceiling that may only go down. An entry leaves once its code is under the limit or
# gone (test_the_size_allow_list_is_current), and nothing new joins the list.
OVER_THE_LIMIT: dict[str, int] = {}


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
