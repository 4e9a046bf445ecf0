"""Every relative link in README.md and docs/*.md points to a file or folder that exists, and a link's anchor into a
Markdown file names one of its headings (GitHub's slugs: lower case, punctuation dropped, spaces as hyphens)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)


def links(text: str) -> list[str]:
    """The targets of the page's inline links outside fenced code, external ones left out."""
    return [target for target in _LINK.findall(_FENCE.sub("", text)) if not re.match(r"[a-z][a-z+.-]*:", target)]


def slug(heading: str) -> str:
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    headings = re.findall(r"^#{1,6} (.+)$", _FENCE.sub("", page.read_text()), re.MULTILINE)
    return {slug(heading) for heading in headings}


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in links(page.read_text()):
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        missing_anchor = anchor and resolved.suffix == ".md" and anchor not in anchors(resolved)
        if not resolved.exists() or missing_anchor:
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: links to nothing: {broken}"


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in links(PAGES[0].read_text())}
    unlinked = [page.name for page in PAGES[1:] if page.resolve() not in linked]
    assert not unlinked, f"README.md does not link: {unlinked}"


def test_the_reader_finds_links_and_slugs() -> None:
    text = "see [a](docs/a.md#x-y) and [b](https://example.org)\n```\n[c](nowhere.md)\n```\n"
    assert links(text) == ["docs/a.md#x-y"]
    assert slug("Tensor parallel on the CPU (`loadtest run`)") == "tensor-parallel-on-the-cpu-loadtest-run"
    assert slug("Embeddings, 2026-11-25") == "embeddings-2026-11-25"
