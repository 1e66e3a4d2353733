"""The docs as a reader sees them: no template left unrendered where figures belong, and every Markdown table whole
(docs/placement.md's results once held `{tables['sia_table']}` where a table of 24 rows belonged)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
TEMPLATE = re.compile(r"\{[A-Za-z_][\w.]*\[['\"]|\{\{|\}\}")  # {name['key'], {{ or }} outside code


def prose(text: str) -> list[tuple[int, str]]:
    """(line number, line) of what is outside fenced code blocks and inline code spans."""
    out, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out.append((n, re.sub(r"`[^`]*`", "``", line)))
    return out


def cells(line: str) -> int:
    return len(line.replace("\\|", "").strip().strip("|").split("|"))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_no_unrendered_template(doc: Path) -> None:
    bad = [f"{doc.name}:{n}: {line.strip()[:80]}" for n, line in prose(doc.read_text()) if TEMPLATE.search(line)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_table_row_has_its_header_s_columns(doc: Path) -> None:
    bad, header = [], None
    for n, line in prose(doc.read_text()):
        if not line.lstrip().startswith("|"):
            header = None
            continue
        if header is None:
            header = cells(line)
        elif cells(line) != header:
            bad.append(f"{doc.name}:{n}: {cells(line)} cells, the header has {header}")
    assert not bad, "\n".join(bad)


def test_the_checks_see_what_they_look_for() -> None:
    assert TEMPLATE.search("{tables['sia_table']}") and not TEMPLATE.search("a {set} of {1, 2}")
    assert [x for _, x in prose("a `{x['y']}` b\n```\n{x['y']}\n```\nc")] == ["a `` b", "c"]
    assert cells("| a | b \\| c | d |") == 3
