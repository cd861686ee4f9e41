"""The dashboard's table cells and columns, shared by :mod:`mtq.dashboard.view` and
its panels (:mod:`mtq.dashboard.tenants`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rich.console import JustifyMethod
from rich.text import Text


def _cell(value: Any, style: str = "") -> Text:
    """One line, cut with an ellipsis where the column is too narrow."""
    return Text(str(value), style=style, no_wrap=True, overflow="ellipsis")


@dataclass(frozen=True)
class Column:
    """A column of a dashboard table. Columns with the highest ``drop`` go first
    when the table is too wide; ``squeeze`` columns give up width first (names,
    errors) before rich narrows the others."""

    header: str
    cell: Callable[[Any], Text]
    drop: int = 0
    justify: JustifyMethod = "right"
    squeeze: bool = False
