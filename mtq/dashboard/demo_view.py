"""The screen of ``mtq demo``: the dashboard's frame over the demo's own progress
(requests submitted and finished, what happened, one user's chat as it streams)."""

from __future__ import annotations

import time
from types import TracebackType
from typing import TYPE_CHECKING

from rich.console import Console
from rich.layout import Layout
from rich.live import Live
from rich.panel import Panel
from rich.text import Text

from mtq.admin import snapshot
from mtq.broker.connection import connect
from mtq.dashboard.view import History, render
from mtq.errors import MtqError

if TYPE_CHECKING:
    from mtq.demo import Tick

#: rows kept for the demo's own panel under the dashboard
PANEL_ROWS = 12


class DemoScreen:
    """A ``Live`` view refreshed by :meth:`tick` (the demo calls it about once a second)."""

    def __init__(self, console: Console, url: str) -> None:
        self.console = console
        self.url = url
        self.client = connect(url)
        self.history = History()
        self.live = Live(console=console, auto_refresh=False, transient=True,
                         vertical_overflow="crop")

    def __enter__(self) -> DemoScreen:
        self.live.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.live.__exit__(kind, exc, tb)

    def tick(self, t: Tick) -> None:
        error = None
        try:
            self.history.add(snapshot(self.client))
        except MtqError as exc:
            error = str(exc)
        height = self.console.size.height
        frame = render(self.history.last, self.history, url=self.url, now=time.time(),
                       error=error)
        lines = Text()
        lines.append(f"{t.elapsed_s:5.1f} s   submitted {t.submitted}/{t.total}   "
                     f"finished {t.finished}/{t.total}\n", style="bold")
        for line in t.events[-3:]:
            lines.append(line + "\n", style="dim")
        chat = "".join(c if c.isprintable() or c == "\n" else "·" for c in t.live_text)
        tail = "\n".join(chat.splitlines()[-4:])
        lines.append(f"{t.live_user}'s chat (TinyGPT, a tiny model trained on Pride and "
                     "Prejudice):\n", style="cyan")
        lines.append(tail)
        panel = Panel(lines, title="mtq demo", height=PANEL_ROWS)
        if height < PANEL_ROWS + 8:  # too small for both: the demo's own panel only
            self.live.update(panel, refresh=True)
            return
        layout = Layout()  # the dashboard gets what the panel leaves of the terminal
        layout.split_column(Layout(frame, name="dashboard"), Layout(panel, size=PANEL_ROWS))
        self.live.update(layout, refresh=True)
