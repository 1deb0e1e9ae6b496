"""``import aadl_func`` stays light: the compile machinery (``torch._dynamo``, about 1.5-3 s on
top of ``import torch``) is imported only where something is compiled.

Each check runs in a fresh interpreter, where nothing else has imported dynamo yet.
"""

from __future__ import annotations

import subprocess
import sys

HEAVY = ["torch._dynamo", "torch._inductor", "sympy"]


def _imported_after(code: str) -> set[str]:
    script = f"import sys\n{code}\nprint(' '.join(sorted(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return set(result.stdout.split())


def test_import_does_not_import_the_compile_machinery():
    modules = _imported_after("import aadl_func")
    assert "aadl_func" in modules
    assert not modules & set(HEAVY), sorted(modules & set(HEAVY))


def test_functional_steps_do_not_import_dynamo():
    # The functional core stepped eagerly needs no dynamo either. (torch.optim's own ``step``
    # imports it, so the wrapper cannot avoid it.)
    code = (
        "import torch, aadl_func as aa\n"
        "params = {'w': torch.ones(3)}\n"
        "opt = aa.anderson(aa.sgd(0.1), history_depth=3, mode='classic')\n"
        "state = opt.init(params)\n"
        "for _ in range(6):\n"
        "    params, state = opt.update(state, params, {'w': 2 * (params['w'] - 2)})\n"
        "assert int(state.num_mixed) > 0"
    )
    assert "torch._dynamo" not in _imported_after(code)
