"""The documentation site builds (``make docs``: strict) and shows no raw reST: the API
reference's docstrings are Markdown, so no ``:math:``, ``:func:``, ``:class:`` or ``.. math::``
reaches a page as text, and math reaches MathJax (arithmatex spans).

The site is built into a temporary folder; the test skips where mkdocs is not installed (the
``docs`` extra).
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RAW_REST = [":math:", ":func:", ":class:", ".. math::"]

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None,
    reason="mkdocs and mkdocstrings (the docs extra) are not installed",
)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


def _text(page: Path) -> str:
    """The page's visible text and code: its HTML without tags and without scripts."""
    html = page.read_text()
    html = re.sub(r"<script.*?</script>", "", html, flags=re.S)
    return re.sub(r"<[^>]+>", "", html)


def test_no_page_shows_raw_rest(site):
    found = {}
    for page in sorted(site.rglob("*.html")):
        text = _text(page)
        hits = [role for role in RAW_REST if role in text]
        if hits:
            found[str(page.relative_to(site))] = hits
    assert not found, found


def test_api_reference_renders_math_and_links(site):
    html = (site / "api" / "index.html").read_text()
    assert html.count('class="arithmatex"') >= 20  # math handed to MathJax, not shown as TeX
    assert 'href="#aadl_func.anderson"' in html  # cross-references are links
    # Compact signatures: the heading is the name, the signature a block below it.
    heading = re.search(r'<h2 id="aadl_func.anderson".*?</h2>', html, re.S).group(0)
    assert "history_depth" not in heading


def test_front_door(site):
    home = (site / "index.html").read_text()
    assert "Quick start: functional" in home  # the README is the home page
    assert 'src="images/digits_demo.png"' in home and (site / "images/digits_demo.png").is_file()
    assert 'src="../images/digits_demo.png"' in (site / "demo" / "index.html").read_text()
    for page in ["install", "guide", "changelog"]:
        assert (site / page / "index.html").is_file(), page
