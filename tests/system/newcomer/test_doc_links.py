"""Every relative link in the README and the docs leads somewhere: the file or folder exists and,
for a Markdown target with a `#section`, that section is one of its headings (GitHub's anchors).

docs/ARCHITECTURE.md is one line per design decision with a link to where its detail lives, so a
moved or renamed section must not leave its link dangling.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
DOCS = sorted(
    [ROOT / "README.md", ROOT / "tests" / "README.md", ROOT / "trainer" / "README.md", *(ROOT / "docs").rglob("*.md")]
)

FENCE = re.compile(r"^(```|~~~)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
LINK = re.compile(r"!?\[[^\]]*\]\(<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\)")
INLINE_CODE = re.compile(r"`[^`]*`")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: links reduced to their text, lower case, punctuation other
    than '-' and '_' dropped, spaces turned into '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file (a repeated heading gets -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    found = set()
    for line in prose_lines(path.read_text()):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[str]:
    """The targets of the Markdown links of a file's prose (inline code spans are not links)."""
    found = []
    for line in prose_lines(path.read_text()):
        found += LINK.findall(INLINE_CODE.sub("", line))
    return found


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """The relative links of `path` whose file, folder or section does not exist (named from `root`)."""
    broken = []
    for target in links(path):
        if SCHEME.match(target):
            continue  # a URL: not checked here (nothing leaves the machine)
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{target}: no such file or folder")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with that anchor in {dest.relative_to(root)}")
    return broken


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    assert path.is_file()
    assert not broken_links(path), f"{path.relative_to(ROOT)}: broken links {broken_links(path)}"


def test_architecture_links_to_its_details():
    """The decisions of docs/ARCHITECTURE.md link to where their detail lives."""
    targets = links(ROOT / "docs" / "ARCHITECTURE.md")
    assert any(t.startswith("history/") and "#" in t for t in targets)
    assert any(t.startswith("BENCHMARKS.md#") for t in targets)


def test_the_checker_finds_broken_links(tmp_path):
    (tmp_path / "other.md").write_text("# The `plan`: a section\n\n## Twice\n\n## Twice\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#the-plan-a-section) [ok](other.md#twice-1) [ok](#here) [url](https://example.com/x)\n"
        "# Here\n"
        "`[not a link](missing.md)`\n"
        "```\n[in code](missing.md)\n```\n"
        "[gone](missing.md) [no section](other.md#nowhere) [no own section](#nowhere)\n"
    )
    assert broken_links(page, tmp_path) == [
        "missing.md: no such file or folder",
        "other.md#nowhere: no heading with that anchor in other.md",
        "#nowhere: no heading with that anchor in page.md",
    ]
