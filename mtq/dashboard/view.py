"""What the dashboard draws: a :class:`~mtq.admin.Snapshot` (plus the
:class:`History` of the ones before it) in, a rich renderable out. Nothing here
talks to Redis or reads the clock, so every frame can be rendered in a test.

A :class:`Frame` lays itself out when rich renders it, for the size it is given:

* a header line (Redis URL without its password, time, refresh interval), then a
  red banner while Redis is unreachable;
* the **queues** table, the **throughput** sparkline (tasks succeeded per second
  over every queue, one bar per refresh), the **workers** table, the **tenants**
  panel of the queues with scheduling on (:mod:`mtq.dashboard.tenants`) and the
  **recent failures and dead letters**;
* below :data:`COMPACT_ROWS` rows only the queues table and a one-line summary;
* tables that are too wide lose their least important columns first, tables that
  are too long end with an "… N more" row, and sections that do not fit at all
  are left out. Every line is one terminal row (cells are cut with "…", never
  wrapped), so a frame never outgrows its height or width.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rich import box
from rich.console import (
    Console,
    ConsoleOptions,
    Group,
    RenderableType,
    RenderResult,
)
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from mtq.admin import QueueView, Snapshot
from mtq.broker.connection import safe_url
from mtq.dashboard.cells import Column, _cell
from mtq.dashboard.tenants import tenant_columns, tenant_rows
from mtq.dashboard.web.fmt import model, who

#: eighths of a bar, lowest first
BARS = "▁▂▃▄▅▆▇█"
#: refreshes the sparkline remembers
SPARK_KEEP = 60
#: below this many rows a frame shows only the queues table and a summary line
COMPACT_ROWS = 20
#: the failures table's error column shows at most this much of an error
ERROR_CHARS = 200
#: a name or error column may be cut this narrow before other columns are dropped
SQUEEZE_TO = 12
#: a worker whose last beat is older than this (s) is shown in yellow, then red
STALE_BEAT_S = (5.0, 15.0)

DASH = "\u2013"  # en dash: no value yet


# -- history -----------------------------------------------------------------------
class History:
    """The snapshots before the current one, as far as a frame needs them: the
    previous snapshot (for rates) and the total rate of the last ``keep`` refreshes
    (for the sparkline)."""

    def __init__(self, keep: int = SPARK_KEEP) -> None:
        self.previous: Snapshot | None = None
        self.last: Snapshot | None = None
        self.totals: deque[float] = deque(maxlen=keep)

    def add(self, snap: Snapshot) -> None:
        """Record a new snapshot (snapshots are expected in time order)."""
        self.previous, self.last = self.last, snap
        total = self.total_rate()
        if total is not None:
            self.totals.append(total)

    def rate(self, queue: str) -> float | None:
        """Tasks of ``queue`` succeeded per second between the last two snapshots;
        None until there are two that both show the queue."""
        if self.previous is None or self.last is None:
            return None
        before, now = self.previous.queue(queue), self.last.queue(queue)
        dt = self.last.ts - self.previous.ts
        if before is None or now is None or dt <= 0:
            return None
        # a counter that went down (the queue was purged and began again) is no rate
        return max(0, now.succeeded - before.succeeded) / dt

    def total_rate(self) -> float | None:
        """The sum of :meth:`rate` over the queues of the last snapshot."""
        if self.previous is None or self.last is None or self.last.ts <= self.previous.ts:
            return None
        return sum(r for q in self.last.queues if (r := self.rate(q.name)) is not None)


def sparkline(values: Sequence[float], width: int | None = None) -> str:
    """One block character per value (the last ``width`` of them), scaled so the
    largest is a full block; zeros and an all-zero series are the lowest block."""
    if width is not None:
        values = values[-width:] if width > 0 else []
    top = max(values, default=0.0)
    if top <= 0:
        return BARS[0] * len(values)
    last = len(BARS) - 1
    return "".join(BARS[min(last, max(0, round(v / top * last)))] for v in values)


# -- cells -------------------------------------------------------------------------
def _rate(value: float | None) -> str:
    if value is None:
        return DASH
    return f"{value:.1f}" if value < 1000 else f"{value:.0f}"


def _ms(value: float | None) -> str:
    if value is None:
        return DASH
    return f"{value:.1f}" if value < 10 else f"{value:.0f}"


def _memory(mem: Any) -> str:
    """Device memory in use / total, both in the unit of the total."""
    if not isinstance(mem, dict) or not mem.get("total"):
        return DASH
    total = float(mem["total"])
    used = float(mem.get("allocated") or mem.get("reserved") or 0)
    unit, scale = next(((u, k) for u, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
                        if total >= k), ("B", 1))
    return f"{used / scale:.1f}/{total / scale:.1f} {unit}"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _clock(ts: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts))


_STATE_STYLE = {"running": "green", "idle": "dim", "paused": "yellow", "draining": "yellow",
                "reloading": "cyan", "starting": "cyan", "stopping": "magenta"}
_STATUS_STYLE = {"dead": "bold red", "failed": "red", "expired": "yellow"}


# -- tables ------------------------------------------------------------------------
def _table(columns: Sequence[Column], items: Sequence[Any], *, width: int, rows: int,
           console: Console, options: ConsoleOptions) -> Table:
    """A borderless table of ``items`` at most ``width`` wide and ``rows`` rows long
    (plus its column names and rule). Past that, the last row says "… N more";
    columns are dropped (highest ``drop`` first) until the table fits with its
    ``squeeze`` columns cut to :data:`SQUEEZE_TO`."""
    shown: list[Any] = list(items)
    more = 0
    if len(shown) > rows >= 2:
        more, shown = len(shown) - rows + 1, shown[:rows - 1]
    shown = shown[:max(rows, 0)]

    def build(kept: list[Column], squeezed: bool) -> Table:
        table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
                      header_style="bold")
        for col in kept:
            table.add_column(_cell(col.header), justify=col.justify,
                             no_wrap=not col.squeeze, overflow="ellipsis",
                             max_width=SQUEEZE_TO if squeezed and col.squeeze else None)
        for item in shown:
            table.add_row(*(col.cell(item) for col in kept))
        if more:
            table.add_row(_cell(f"… {more} more", "dim"), *([""] * (len(kept) - 1)))
        return table

    kept = list(columns)
    wide = options.update_width(10_000)
    while len(kept) > 1 and Measurement.get(console, wide, build(kept, True)).maximum > width:
        worst = max(range(len(kept)), key=lambda i: (kept[i].drop, i))
        if kept[worst].drop == 0:
            break  # only essential columns left: rich narrows them
        del kept[worst]
    return build(kept, False)


def queue_columns(rates: dict[str, float | None]) -> list[Column]:
    """The queues table: name, depth, throughput, latency, workers."""
    def num(attr: str, style: Callable[[int], str] = lambda _: "") -> Callable[[Any], Text]:
        return lambda q: _cell(getattr(q, attr), style(getattr(q, attr)))

    return [
        Column("queue", lambda q: _cell(q.name, "bold"), 0, "left", squeeze=True),
        Column("waiting", num("waiting", lambda n: "bold" if n else "dim"), 0),
        Column("tasks/s", lambda q: _cell(_rate(rates.get(q.name)), "green"), 1),
        Column("running", num("running"), 2),
        Column("workers", num("workers", lambda n: "" if n else "yellow"), 3),
        Column("dead", num("dead", lambda n: "bold red" if n else "dim"), 4),
        Column("p99 ms", lambda q: _cell(_ms(q.p99_ms)), 5),
        Column("p50 ms", lambda q: _cell(_ms(q.p50_ms)), 6),
        Column("streams", num("streams"), 7),
        Column("delayed", num("delayed", lambda n: "yellow" if n else "dim"), 8),
    ]


def _beat(w: dict[str, Any]) -> Text:
    age = w.get("heartbeat_age_s")
    if not isinstance(age, (int, float)):
        return _cell(DASH)
    style = "red" if age > STALE_BEAT_S[1] else "yellow" if age > STALE_BEAT_S[0] else ""
    return _cell(f"{age:.1f}s", style)


def _batch(w: dict[str, Any]) -> str:
    return f"{w.get('batch', 0)}/{w.get('typical_batch', 0) or DASH}"


def _per_s(w: dict[str, Any]) -> str:
    value = w.get("tasks_per_s")
    return _rate(float(value)) if isinstance(value, (int, float)) else DASH


def worker_columns() -> list[Column]:
    """The workers table: who, what, how busy, how healthy."""
    return [
        Column("host", lambda w: _cell(who(w)), 0, "left", squeeze=True),
        Column("state", lambda w: _cell(w.get("state", "?"),
                                         _STATE_STYLE.get(w.get("state", ""), "red")), 0, "left"),
        Column("batch", lambda w: _cell(_batch(w)), 1),
        Column("tasks/s", lambda w: _cell(_per_s(w), "green"), 2),
        Column("beat", _beat, 3),
        Column("queue", lambda w: _cell(w.get("queue", DASH)), 4, "left", squeeze=True),
        Column("model", lambda w: _cell(model(w)), 5, "left", squeeze=True),
        Column("device", lambda w: _cell(w.get("device", DASH)), 6, "left"),
        Column("memory", lambda w: _cell(_memory(w.get("memory"))), 7),
    ]


def _version(m: dict[str, Any]) -> Text:
    text = str(m.get("version") or DASH)
    return _cell(text, "") if m.get("current", True) else _cell(f"{text} (old)", "yellow")


def model_columns() -> list[Column]:
    """The models table (the model catalogue): what each queue serves, how many live
    replicas, on what, since when."""
    return [
        Column("queue", lambda m: _cell(m.get("queue", DASH)), 0, "left", squeeze=True),
        Column("model", lambda m: _cell(str(m.get("target") or m.get("model") or DASH)), 0,
               "left", squeeze=True),
        Column("version", _version, 1, "left", squeeze=True),
        Column("replicas", lambda m: _cell(str(m.get("replicas", 0)),
                                           "" if m.get("replicas") else "red"), 0),
        Column("devices", lambda m: _cell(", ".join(m.get("devices") or []) or DASH), 3, "left",
               squeeze=True),
        Column("loaded", lambda m: _cell(_clock(m["loaded"] / 1000) if m.get("loaded")
                                         else DASH), 2),
    ]


def _error_line(error: Any) -> str:
    text = str(error or "").strip()
    first = text.splitlines()[-1] if text else ""  # a traceback's last line says what
    return first[:ERROR_CHARS]


def failure_columns() -> list[Column]:
    """The recent failures table: when, where, which task, why."""
    return [
        Column("time", lambda f: _cell(_clock(float(f.get("ts") or 0) / 1000), "dim"), 3, "left"),
        Column("queue", lambda f: _cell(f["queue"]), 2, "left", squeeze=True),
        Column("id", lambda f: _cell(f.get("id", "?")), 1, "left", squeeze=True),
        Column("status", lambda f: _cell(f.get("status", "?"),
                                          _STATUS_STYLE.get(f.get("status", ""), "red")),
               0, "left"),
        Column("error", lambda f: _cell(_error_line(f.get("error"))), 0, "left", squeeze=True),
    ]


def recent_failures(queues: Iterable[QueueView]) -> list[dict[str, Any]]:
    """Every queue's recent failures, newest first, each with its ``queue``."""
    rows = [{**f, "queue": q.name} for q in queues for f in q.failures]
    return sorted(rows, key=lambda f: f.get("ts") or 0, reverse=True)


# -- the frame ---------------------------------------------------------------------
def _line(text: str | Text, style: str = "") -> Text:
    line = text if isinstance(text, Text) else Text(text, style=style)
    line.no_wrap = True
    line.overflow = "ellipsis"
    return line


@dataclass(frozen=True)
class Frame:
    """One screen of the dashboard, laid out for whatever size rich renders it at
    (see the module docstring). Build it with :func:`render`."""

    snapshot: Snapshot | None
    url: str
    now: float
    refresh_s: float = 1.0
    error: str | None = None
    rates: dict[str, float | None] = field(default_factory=dict)
    total_rate: float | None = None
    series: tuple[float, ...] = ()
    #: how to quit, at the end of the header ("" for none)
    hint: str = "q quits"

    def header(self) -> Text:
        line = Text()
        line.append("mtq dashboard", "bold")
        line.append(f"  {safe_url(self.url)}  {_clock(self.now)}  "
                    f"refresh every {self.refresh_s:g} s", "dim")
        if self.hint:
            line.append(f"  {self.hint}", "dim")
        return _line(line)

    def banner(self) -> Text | None:
        if self.error is None:
            return None
        seen = (f"showing the snapshot of {_clock(self.snapshot.ts)}" if self.snapshot
                else "no snapshot yet")
        return _line(f"Redis unreachable; retrying ({seen}): {self.error}", "bold white on red")

    def summary(self) -> Text:
        snap = self.snapshot
        assert snap is not None
        failures = sum(len(q.failures) for q in snap.queues)
        parts = [_count(len(snap.queues), "queue"),
                 f"{sum(q.waiting for q in snap.queues)} waiting",
                 f"{sum(q.running for q in snap.queues)} running",
                 f"{sum(q.dead for q in snap.queues)} dead",
                 f"{_rate(self.total_rate)} tasks/s",
                 _count(len(snap.workers), "worker"),
                 _count(failures, "recent failure")]
        return _line(" · ".join(parts), "dim")

    def throughput(self, width: int) -> Text:
        label = Text("throughput ", "bold")
        tail = f" {_rate(self.total_rate)} tasks/s"
        if self.series:
            tail += f" (max {_rate(max(self.series))})"
        room = max(0, width - len(label) - len(tail))
        label.append(sparkline(self.series, room), "green")
        label.append(tail)
        return _line(label)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = max(1, options.max_width)
        height = max(1, options.height or console.height)
        out: list[RenderableType] = [self.header()]
        banner = self.banner()
        if banner is not None and height > 1:
            out.append(banner)
        snap = self.snapshot
        if snap is None:
            out.append(_line("waiting for the first snapshot…", "dim"))
            yield Group(*out[:height])  # one line each
            return
        left = height - len(out)

        def section(title: str, columns: Sequence[Column], items: Sequence[Any],
                    room: int, *, titled: bool = True) -> int:
            """Add a table in at most ``room`` lines (its title, column names and
            rule included); returns the lines used."""
            if not items:
                if titled and room >= 1:
                    out.append(_line(f"{title}: none", "dim"))
                    return 1
                return 0
            head = 3 if titled else 2
            rows = room - head
            if rows < 1:
                return 0
            if titled:
                out.append(_line(title, "bold"))
            out.append(_table(columns, items, width=width, rows=rows, console=console,
                              options=options))
            return head + min(rows, len(items))

        qcols = queue_columns(self.rates)
        if height < COMPACT_ROWS:
            left -= section("queues", qcols, snap.queues, left - 1, titled=False)
            if left >= 1:
                out.append(self.summary())
            yield Group(*out)
            return

        if not snap.queues:
            out.append(_line("no queues yet (a queue appears when a task is submitted)", "dim"))
            left -= 1
        else:  # all the queues, unless that leaves under 10 lines for the rest
            left -= section("queues", qcols, snap.queues, max(4, left - 10))
        if left >= 1:
            out.append(self.throughput(width))
            left -= 1
        workers = sorted(snap.workers, key=lambda w: (str(w.get("queue")), who(w)))
        failures = recent_failures(snap.queues)
        # the workers leave room for the failures' title, column names, rule and a row,
        # for the models' title, column names, rule and up to three rows, and for the
        # tenants' and up to four rows
        after = 4 if failures else 1
        models = 3 + min(len(snap.models), 3) if snap.models else 0
        tenants = tenant_rows(snap.queues)  # queues with scheduling on only
        trows = 3 + min(len(tenants), 4) if tenants else 0
        room = left - after - models - trows
        left -= section("workers", worker_columns(), workers, room if room >= 4 else left)
        if snap.models and left - after >= 4:
            room = left - after - trows
            left -= section("models", model_columns(), snap.models,
                            room if room >= 4 else left - after)
        if tenants and left - after >= 4:
            left -= section("tenants (busiest first)", tenant_columns(), tenants, left - after)
        section("recent failures and dead letters", failure_columns(), failures, left)
        yield Group(*out)


def render(snapshot: Snapshot | None, history: History, *, url: str,
           refresh_s: float = 1.0, now: float | None = None,
           error: str | None = None, hint: str = "q quits") -> Frame:
    """The frame showing ``snapshot`` (None before the first one) with the rates
    of ``history`` (whose last snapshot should be ``snapshot``) and, while Redis
    is unreachable, the ``error``. ``now`` defaults to the snapshot's time;
    ``hint`` ends the header (how to quit)."""
    names = [q.name for q in snapshot.queues] if snapshot else []
    when = now if now is not None else (snapshot.ts if snapshot else 0.0)
    return Frame(snapshot=snapshot, url=url, now=when, refresh_s=refresh_s, error=error,
                 hint=hint, rates={n: history.rate(n) for n in names},
                 total_rate=history.total_rate(), series=tuple(history.totals))
