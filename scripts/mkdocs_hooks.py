"""mkdocs hooks (mkdocs.yml ``hooks:``): the site's home page is the README, its changelog page
CHANGELOG.md, so that neither is written twice.

``docs/index.md`` and ``docs/changelog.md`` are stubs that say so; at build time their Markdown
is replaced by the file's, with the links rewritten for the site: ``docs/x.md`` is the page
``x.md`` beside the home page, ``docs/images/...`` its image, ``CHANGELOG.md`` the changelog
page, and a link to another file of the checkout (``examples/pinn.py``) becomes its path as
code, since the site does not carry the sources.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

SOURCES = {"index.md": "README.md", "changelog.md": "CHANGELOG.md"}


def site_links(text: str) -> str:
    """The checkout-relative links of a top-level Markdown file, as the site's pages see them."""
    text = re.sub(r"\[docs/([^\]]+)\]\(docs/", r"[\1](docs/", text)  # shown as on the site
    text = text.replace("](docs/", "](").replace("](CHANGELOG.md)", "](changelog.md)")
    return re.sub(r"\[([^\]]+)\]\((?!https?:)([^)#]+\.(?:py|sh|json))\)", r"`\2`", text)


def on_page_markdown(markdown: str, page: Any, config: Any, **kwargs: Any) -> str:
    source = SOURCES.get(page.file.src_uri)
    if source is None:
        return markdown
    return site_links((Path(config.config_file_path).parent / source).read_text())
