"""scripts/compat.py (``make compat``) pairs the ends of torch and optree: the oldest optree
with the oldest torch, the newest with the newest; the floors are pyproject.toml's."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import compat  # noqa: E402


def test_declared_floors_are_pyprojects():
    text = (ROOT / "pyproject.toml").read_text()
    assert f'"torch>={compat.declared_floor("torch")}"' in text
    assert f'"optree>={compat.declared_floor("optree")}"' in text


def test_oldest_optree_goes_with_the_oldest_torch(monkeypatch):
    served = {"optree": ["0.13.0", "0.20.0"]}
    monkeypatch.setattr(compat, "default_versions", lambda python, package="torch": served[package])
    pairs = compat.optree_for(["2.13.0", "2.5.0"], None, sys.executable)
    assert pairs == {"2.5.0": "0.13.0", "2.13.0": "0.20.0"}
    assert compat.optree_for(["2.5.0"], "0.14.1", sys.executable) == {"2.5.0": "0.14.1"}


def test_default_versions_keeps_the_supported_ends(monkeypatch):
    available = ["0.11.0", "0.12.1", "0.13.0", "0.14.1", "0.20.0"]
    monkeypatch.setattr(compat, "index_versions", lambda python, package="torch": available)
    monkeypatch.setattr(compat, "declared_floor", lambda package="torch": "0.13")
    assert compat.default_versions(sys.executable, "optree") == ["0.13.0", "0.20.0"]
