"""The tables of README.md and docs/*.md render as tables: a row that has drifted away
from its table (below a list, after a blank line) shows as a paragraph of pipes, and
a row with more cells than its header loses the extra ones without a word. Rendered
with markdown-it-py (rich's markdown parser) and its GFM table rule."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

from tests.support.doc_commands import ROOT, pages

PAGES = pages()


def cells(row: str) -> int:
    """The cells of a table row, as GFM splits it: at every pipe not escaped with a
    backslash (code spans included), outer pipes aside."""
    return len(re.split(r"(?<!\\)\|", row.strip().removeprefix("|").removesuffix("|")))


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_table_row_renders_in_its_table(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    lines = text.splitlines()
    tokens = MarkdownIt("commonmark").enable("table").parse(text)
    tables = [t.map for t in tokens if t.type == "table_open" and t.map]
    verbatim = {i for t in tokens if t.type in ("fence", "code_block") and t.map
                for i in range(*t.map)}
    in_table = {i for a, b in tables for i in range(a, b)}
    stray = [f"{page.name}:{i + 1}: {line[:80]}" for i, line in enumerate(lines)
             if line.lstrip().startswith("|") and i not in in_table | verbatim]
    assert not stray, "table rows that render as text, not in their table:\n" + \
        "\n".join(stray)
    for a, b in tables:
        want = cells(lines[a])
        wrong = [f"{page.name}:{i + 1}: {cells(lines[i])} cells, its header has {want}"
                 for i in range(a, b) if cells(lines[i]) != want]
        assert not wrong, "\n".join(wrong)
