"""mkdocs.yml's nav lists every page under docs/ and only pages that exist.

Zensical (``make docs``) checks links and anchors strictly but not the nav, which MkDocs' strict
build did (``validation.nav``): a page left out of nav is not reachable from the site's menu.
"""

from __future__ import annotations

from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def nav_pages(nav: object) -> list[str]:
    """Every page path (relative to docs/) in a nav tree of lists, ``{title: page}`` maps and
    bare page strings."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [page for item in nav for page in nav_pages(item)]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in nav_pages(value)]
    raise TypeError(f"mkdocs.yml nav: unexpected entry {nav!r}")


def test_nav_lists_every_page_once_and_no_missing_page():
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    docs = REPO / config["docs_dir"]
    listed = nav_pages(config["nav"])
    on_disk = sorted(str(p.relative_to(docs)) for p in docs.rglob("*.md"))
    assert len(listed) == len(set(listed)), f"listed twice: {sorted(listed)}"
    assert sorted(set(on_disk) - set(listed)) == [], "pages missing from mkdocs.yml nav"
    assert sorted(set(listed) - set(on_disk)) == [], "nav entries with no page under docs/"


def test_nav_pages_finds_pages_at_every_depth():
    nav = ["index.md", {"A": "a.md"}, {"B": [{"C": "b/c.md"}, "d.md"]}]
    assert nav_pages(nav) == ["index.md", "a.md", "b/c.md", "d.md"]
