"""The README is a short front door and docs/ holds the rest: every page linked, every link live,
and no history (dates, commit ids) in either."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"

#: README prose (outside ``` blocks and table rows) stays under this many words
README_PROSE_WORDS = 1600

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
MONTHS = (
    "January|February|March|April|May|June|July|August|September|October|November|December|"
    "Jan|Feb|Mar|Apr|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec"
)
DATE = re.compile(
    rf"\b(?:19|20)\d\d(?:-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])\b|[ ,/-]+(?:{MONTHS})\b)"
    rf"|\b(?:{MONTHS})\.? +(?:\d{{1,2}}, +)?(?:19|20)\d\d\b"
)
#: a commit id as prose names one: "commit abc1234", "(abc1234)",
#: `abc1234` with at least one digit and one letter
COMMIT = re.compile(
    r"\b(?:commit|revision|rev|sha)s?[ :]+`?[0-9a-f]{7,40}\b"
    r"|[(`](?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}[)`]",
    re.I,
)


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def _without_code_blocks(text: str) -> str:
    return re.sub(r"^```.*?^```[^\n]*$", "", text, flags=re.S | re.M)


def _prose(text: str) -> str:
    lines = _without_code_blocks(text).splitlines()
    return "\n".join(ln for ln in lines if not ln.lstrip().startswith("|"))


def _links(path: Path) -> list[str]:
    return LINK.findall(_without_code_blocks(path.read_text()))


def _local(target: str) -> str | None:
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
        return None  # http(s), mailto, ...; in-page anchors
    return target.split("#", 1)[0]


def test_readme_prose_is_short() -> None:
    words = len(_prose(README.read_text()).split())
    assert words <= README_PROSE_WORDS, (
        f"README.md has {words} words of prose (outside code blocks and tables), more than "
        f"{README_PROSE_WORDS}: move detail into a docs/ page and link it"
    )


def test_readme_links_every_docs_page_and_only_existing_ones() -> None:
    linked = {
        (ROOT / t).resolve()
        for t in filter(None, map(_local, _links(README)))
        if Path(t).parts[:1] == ("docs",)
    }
    pages = {p.resolve() for p in DOCS.glob("*.md")}
    assert pages, "docs/ has no pages"
    assert not linked - pages, (
        f"README.md links docs pages that do not exist: {sorted(map(str, linked - pages))}"
    )
    assert not pages - linked, (
        f"docs pages not linked from README.md: {sorted(p.name for p in pages - linked)}"
    )


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page: Path) -> None:
    dead = [
        t for t in filter(None, map(_local, _links(page))) if t and not (page.parent / t).exists()
    ]
    assert not dead, f"{page.relative_to(ROOT)}: links to missing files {dead}"


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_dates_or_commit_ids(page: Path) -> None:
    text = page.read_text()
    dates = [m.group(0) for m in DATE.finditer(text)]
    commits = [m.group(0) for m in COMMIT.finditer(_without_code_blocks(text))]
    assert not dates, (
        f"{page.relative_to(ROOT)} carries dates (history belongs in git, not the docs): {dates}"
    )
    assert not commits, (
        f"{page.relative_to(ROOT)} names commits (history belongs in git, not the docs): {commits}"
    )


def test_the_checks_see_what_they_look_for() -> None:
    """The patterns catch the history they are for and leave ordinary text alone."""
    for dated in ("2026-11-24", "the run of 2025 November", "Nov 24, 2026", "(2026-11-23, load 2)"):
        assert DATE.search(dated), dated
    for plain in ("seq 2048 tokens", "torch 2.13", "1024 x 2048", "2026 bytes", "W=2026"):
        assert not DATE.search(plain), plain
    for named in ("at the commit before (`384888c`)", "commit 4ef480c", "rev: deadbeef12"):
        assert COMMIT.search(named), named
    for plain in (
        "a `deadbeef` value",
        "(accumulated)",
        "`facade`",
        "(1234567)",
        "commit the change",
    ):
        assert not COMMIT.search(plain), plain
    assert _prose("a b\n```\nc d e\n```\n| x | y |\nf").split() == ["a", "b", "f"]
