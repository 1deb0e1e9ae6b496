"""The rule of `aadl_func/_src/core/` (docs/architecture.md): the math imports nothing of the
package outside `core/` and asks nothing about how it is run; and the execution layer's
answers to its questions (`exec.ops.OPS`) give the bits of the answers that read no value
(`core.ops.PLAIN`)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import aadl_func
from aadl_func._src.core import lstsq
from aadl_func._src.core.ops import PLAIN
from aadl_func._src.exec.ops import OPS

CORE = Path(aadl_func.__file__).parent / "_src" / "core"

# Names that ask how a computation runs, or that carry an execution concern into the math.
FORBIDDEN_NAMES = {
    "compiler",
    "is_compiling",
    "functorch",
    "_functorch",
    "tracing",
    "static_value",
    "is_transformed",
    "any_transformed",
    "readable",
    "uniform_value",
    "inplace",
    "blend",
    "Blend",
    "shards",
    "progress",
    "Progress",
    "guard",
    "InterruptGuard",
    "all_reduce",
    "distributed",
}


def violations(source: str) -> list[str]:
    """What in `source` (a core module) breaks the rule: package imports from outside
    `core/` (at any depth, also inside functions) and forbidden names or attributes."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                found.append(f"relative import at line {node.lineno}")
            elif module.startswith("aadl_func") and not module.startswith("aadl_func._src.core"):
                found.append(f"imports {module} at line {node.lineno}")
            found.extend(
                f"imports {alias.name} at line {node.lineno}"
                for alias in node.names
                if alias.name in FORBIDDEN_NAMES
            )
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("aadl_func") and not alias.name.startswith(
                    "aadl_func._src.core"
                ):
                    found.append(f"imports {alias.name} at line {node.lineno}")
                if any(part in FORBIDDEN_NAMES for part in alias.name.split(".")):
                    found.append(f"imports {alias.name} at line {node.lineno}")
        elif isinstance(node, ast.Name) and node.id in FORBIDDEN_NAMES:
            found.append(f"uses {node.id} at line {node.lineno}")
        elif isinstance(node, ast.Attribute) and node.attr in FORBIDDEN_NAMES:
            found.append(f"uses .{node.attr} at line {node.lineno}")
        elif isinstance(node, ast.arg) and node.arg in FORBIDDEN_NAMES:
            found.append(f"takes {node.arg} at line {node.lineno}")
    return found


def core_modules() -> list[Path]:
    return sorted(CORE.rglob("*.py"))


def test_core_holds_the_math_modules():
    names = {p.relative_to(CORE).as_posix() for p in core_modules()}
    assert {"lstsq.py", "grams.py", "accept.py", "linesearch.py", "ops.py"} <= names
    assert {"variants/aadl.py", "variants/classic.py"} <= names


@pytest.mark.parametrize("path", core_modules(), ids=lambda p: p.relative_to(CORE).as_posix())
def test_core_module_keeps_the_rule(path):
    assert violations(path.read_text()) == [], path


@pytest.mark.parametrize(
    "source",
    [
        "from aadl_func._src import tree\n",
        "import aadl_func._src.flags\n",
        "def f(t):\n    from aadl_func._src.exec.ops import OPS\n    return OPS\n",
        "import torch\nx = torch.compiler.is_compiling()\n",
        "def f(t, inplace):\n    return t\n",
        "def f(call):\n    return call.shards\n",
        "from torch._C import _functorch\n",
        "from . import lstsq\n",
    ],
)
def test_the_rule_check_finds_a_breach(source):
    """The check has teeth: each of these breaches is reported."""
    assert violations(source)


def test_the_rule_check_passes_clean_math():
    assert violations("import torch\n\ndef f(a, ops):\n    return ops.where(a > 0, a, 0.0)\n") == []


# -- the execution layer's answers give the same bits as the plain ones ---------------------
def _window(q: int, seed: int, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    f = torch.randn(50, q, generator=g, dtype=torch.float64) * scale
    f[:, -1] *= 1e-3  # a converging tail: the newest residual small
    d = f[:, 1:] - f[:, :-1]
    return f, d


@pytest.mark.parametrize("num_valid", [2, 4, 6])
@pytest.mark.parametrize("reg", [0.0, 1e-6])
@pytest.mark.parametrize("poison", [False, True])
def test_solve_differences_known_and_plain_answers_agree(num_valid, reg, poison):
    f, d = _window(6, num_valid, 1e3)
    h, c, norms = d.T @ d, d.T @ f[:, -1], (f * f).sum(0)
    if poison:
        h[-1, -1] = float("nan")
    plain = lstsq.solve_differences(h, c, norms, num_valid, reg, ops=PLAIN)
    known = lstsq.solve_differences(h, c, norms, torch.tensor(num_valid), reg, ops=OPS)
    for a, b in zip(plain, known):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    assert bool(plain.ok) is not poison


@pytest.mark.parametrize("valid", [[True] * 5, [False, False, True, True, True]])
def test_solve_factor_known_and_plain_answers_agree(valid):
    f, d = _window(6, 7)
    factor = lstsq.stack_factors([torch.cat([d, f[:, -1:]], dim=1)])
    valid = torch.tensor(valid)
    plain = lstsq.solve_factor(factor, valid, 1e-8, ops=PLAIN)
    known = lstsq.solve_factor(factor, valid, 1e-8, ops=OPS)
    for a, b in zip(plain, known):
        assert torch.equal(a, b)


def test_ops_known_reads_only_plain_values():
    """`OPS.value` reads a plain 0-d CPU tensor and nothing under vmap; `PLAIN` never reads."""
    assert OPS.value(torch.tensor(3)) == 3
    assert PLAIN.value(torch.tensor(3)) is None
    seen = []
    torch.func.vmap(lambda t: seen.append(OPS.value(t)) or t)(torch.arange(3))
    assert seen == [None]
