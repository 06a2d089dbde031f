"""The README and docs/ hold together: every relative link and anchor resolves, and the README stays short
enough to be read to the end (the details live in docs/)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

DOCUMENTS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
README_MAX_BYTES = 25_000
FENCED = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def anchors(document: Path) -> set[str]:
    """The anchors GitHub gives the document's headings (lower case, punctuation dropped, spaces to '-', a
    repeated heading numbered), and its explicit ``<a id="...">`` ones."""
    text = document.read_text()
    found: set[str] = set(re.findall(r'<a id="([^"]+)"', text))
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*$", FENCED.sub("", text), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return found


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: str(path.relative_to(REPO_ROOT)))
def test_every_relative_link_and_anchor_resolves(document):
    broken = []
    for target in LINK.findall(FENCED.sub("", document.read_text())):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        resolved = (document.parent / path).resolve() if path else document
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            broken.append(f"{target}: no such heading")
    assert broken == []


def test_the_readme_is_short_enough_to_read_to_the_end():
    size = len((REPO_ROOT / "README.md").read_bytes())
    assert size < README_MAX_BYTES, f"README.md is {size} bytes: move details to docs/"
