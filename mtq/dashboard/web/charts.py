"""Charts as numbers for the templates: series in, the ``d`` of SVG paths and the
axis labels out. The SVG itself is written by the templates (``_chart.html``), so
the same escaping applies to it as to everything else; nothing here is markup.

Server-rendered SVG needs no JavaScript chart library (nothing to vendor, nothing
from a CDN), shows without JavaScript, and is swapped in by the live updates as any
other fragment.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from mtq.broker.records import TERMINAL

Series = Sequence[tuple[float, float | None]]


@dataclass(frozen=True)
class Line:
    """One series of a chart: its CSS class, its legend and its path (``d``)."""

    css: str
    label: str
    d: str
    last: float | None


@dataclass(frozen=True)
class Chart:
    """A chart of one or more series sharing a time axis and a y scale from 0."""

    width: int
    height: int
    lines: list[Line] = field(default_factory=list)
    #: the top of the y scale, as shown
    top: str = "0"
    #: the time axis' left end ("-5 min") and right end ("now")
    since: str = ""
    empty: bool = True


def _nice(v: float) -> float:
    """The smallest of 1, 2, 5 x 10^k at least ``v`` (a round top for the y scale)."""
    if v <= 0:
        return 1.0
    k = 10.0 ** math.floor(math.log10(v))
    return next(k * m for m in (1, 2, 5, 10) if k * m >= v * (1 - 1e-9))


def _fmt(v: float) -> str:
    if v >= 1000:
        return f"{v / 1000:g}k"
    return f"{v:g}"


def _span(s: float) -> str:
    return f"-{s / 60:.0f} min" if s >= 120 else f"-{s:.0f} s" if s >= 1 else "-1 s"


def chart(series: Sequence[tuple[str, str, Series]], *, width: int = 160, height: int = 36,
          window_s: float = 300.0, pad: int = 2) -> Chart:
    """A chart of ``series`` ((css class, label, points)), all on one y scale from 0
    to a round top, over the last ``window_s`` seconds ending at the newest point (or
    over the history there is, when it is shorter)."""
    stamps = [t for _, _, pts in series for t, _ in pts]
    values = [v for _, _, pts in series for _, v in pts if v is not None]
    if not stamps or not values:
        return Chart(width, height, [Line(css, label, "", None) for css, label, _ in series],
                     since=_span(window_s))
    end = max(stamps)
    # a history shorter than the window (the dashboard started lately) spans the chart
    window_s = min(window_s, max(end - min(stamps), 1.0))
    start = end - window_s
    top = _nice(max(values))
    inner_w, inner_h = width - 2 * pad, height - 2 * pad

    def x(t: float) -> float:
        return pad + inner_w * (t - start) / window_s

    def y(v: float) -> float:
        return pad + inner_h * (1 - min(v, top) / top)

    lines = []
    for css, label, pts in series:
        parts: list[str] = []
        gap = True
        last = None
        for t, v in pts:
            if v is None or t < start:
                gap = True
                continue
            parts.append(f"{'M' if gap else 'L'}{x(t):.1f} {y(v):.1f}")
            gap = False
            last = v
        lines.append(Line(css, label, " ".join(parts), last))
    return Chart(width, height, lines, _fmt(top), _span(window_s), empty=False)


# -- a task's timeline ---------------------------------------------------------------
#: what a task does after each kind of trace entry ("" : as before)
_STATE_AFTER = {"queued": "wait", "released": "wait", "retry": "wait", "restarted": "wait",
                "started": "run"}


@dataclass(frozen=True)
class Span:
    x: float
    w: float
    css: str
    label: str


@dataclass(frozen=True)
class Mark:
    x: float
    kind: str
    at: str
    detail: str
    row: int


@dataclass(frozen=True)
class Timeline:
    width: int
    height: int
    spans: list[Span]
    marks: list[Mark]
    total: str


def _dur(s: float) -> str:
    if s < 1:
        return f"{s * 1000:.0f} ms"
    return f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min"


def timeline(entries: Sequence[tuple[float, str, str]], now: float, *, width: int = 760,
             height: int = 64, pad: int = 8) -> Timeline:
    """A task's life ((time s, kind, detail), oldest first) as spans of waiting and
    running on one axis; a task not ended runs on to ``now``."""
    if not entries:
        return Timeline(width, height, [], [], "")
    start = entries[0][0]
    ended = entries[-1][1] in TERMINAL
    end = entries[-1][0] if ended else max(now, entries[-1][0])
    total = max(end - start, 1e-3)
    inner = width - 2 * pad

    def x(t: float) -> float:
        return pad + inner * (t - start) / total

    spans, marks = [], []
    state = ""
    for i, (t, kind, detail) in enumerate(entries):
        state = _STATE_AFTER.get(kind, state)
        nxt = entries[i + 1][0] if i + 1 < len(entries) else (None if ended else end)
        if nxt is not None and state and kind not in TERMINAL:
            spans.append(Span(x(t), max(x(nxt) - x(t), 1.0), state,
                              f"{'waiting' if state == 'wait' else 'running'} {_dur(nxt - t)}"))
        marks.append(Mark(x(t), kind, f"+{_dur(t - start)}", detail, i % 2))
    return Timeline(width, height, spans, marks, _dur(end - start))
