"""The dashboard's frames, rendered from hand-built snapshots at several terminal sizes."""

from __future__ import annotations

import re
from typing import Any

import pytest
from rich.cells import cell_len
from rich.console import Console

from mtq.admin import QueueView, Snapshot
from mtq.dashboard.view import BARS, DASH, History, render, safe_url, sparkline

URL = "redis://:hunter2@cache.internal:6380/2"
T0 = 1_700_000_000.0


def queues(succeeded: int = 0, failures: bool = True) -> list[QueueView]:
    embed = QueueView(
        name="embed", waiting=1234, streams=56, running=7, delayed=3, dead=2,
        succeeded=succeeded, p50_ms=12.5, p99_ms=840.0, workers=2,
        failures=[{"id": "a1b2c3d4e5f6", "status": "dead", "ts": T0 * 1000,
                   "error": "Traceback (most recent call last):\nValueError: bad shape (3, 4)"}]
        if failures else [])
    chat = QueueView(
        name="chat-completions", waiting=0, succeeded=succeeded // 2, p50_ms=3.25,
        failures=[{"id": "ff00ff00", "status": "expired", "ts": T0 * 1000 - 5000, "error": None}]
        if failures else [])
    return [chat, embed]


WORKERS: list[dict[str, Any]] = [
    {"id": "w1", "host": "gpu-node-01", "pid": 4242, "queue": "embed", "device": "cuda:0",
     "model": "minilm", "version": "3", "state": "running", "batch": 24, "typical_batch": 32,
     "tasks_per_s": 210.5, "heartbeat_age_s": 0.4,
     "memory": {"allocated": 3 * 2**30, "reserved": 4 * 2**30, "total": 80 * 2**30}},
    {"id": "w2", "host": "cpu-box", "pid": 7, "queue": "embed", "device": "cpu",
     "model": "minilm", "version": "3", "state": "idle", "batch": 0, "typical_batch": 0,
     "tasks_per_s": 0.0, "heartbeat_age_s": 7.2},
]


MODELS: list[dict[str, Any]] = [
    {"queue": "embed", "model": "minilm", "version": "3", "target": "examples.embeddings:MiniLM",
     "kind": "model", "replicas": 2, "hosts": ["cpu-box", "gpu-node-01"],
     "devices": ["cpu", "cuda:0"], "loaded": T0 * 1000 - 60_000, "current": True},
    {"queue": "embed", "model": "minilm", "version": "2", "target": None, "kind": "model",
     "replicas": 1, "hosts": ["old-box"], "devices": ["cuda:1"], "loaded": None,
     "current": False},
    {"queue": "chat-completions", "model": None, "version": "h-9f8e", "target": "gpt:Tiny",
     "kind": "generator", "replicas": 0, "hosts": ["gone"], "devices": [], "loaded": None,
     "current": True},
]


def history(n: int = 2, step: int = 100, models: list[dict[str, Any]] | None = None
            ) -> History:
    """``n`` snapshots one second apart, ``embed`` succeeding ``step`` tasks a second."""
    h = History()
    for i in range(n):
        h.add(Snapshot(T0 + i, queues(step * i), WORKERS,
                       MODELS if models is None else models))
    return h


def show(frame: Any, width: int, height: int) -> list[str]:
    """The frame's lines at this size, checked to fit it."""
    console = Console(record=True, width=width, height=height, color_system=None,
                      legacy_windows=False)
    console.print(frame)
    lines = console.export_text().splitlines()
    assert len(lines) <= max(height, 1), f"{len(lines)} lines at {width}x{height}:\n" + \
        "\n".join(lines)
    wide = [x for x in lines if cell_len(x) > width]
    assert not wide, f"lines wider than {width}: {wide}"
    return lines


def frame(h: History | None = None, **kw: Any) -> Any:
    h = h or history()
    return render(h.last, h, url=URL, **kw)


def test_a_big_terminal_shows_every_section_and_column() -> None:
    text = "\n".join(show(frame(), 160, 50))
    assert "cache.internal:6380/2" in text and "hunter2" not in text
    assert "refresh every 1 s" in text
    for header in ("queue", "waiting", "streams", "running", "delayed", "dead", "tasks/s",
                   "p50 ms", "p99 ms", "workers"):
        assert header in text
    assert "1234" in text and "chat-completions" in text
    for cell in ("gpu-node-01:4242", "cuda:0", "minilm/3", "running", "24/32", "210.5",
                 "3.0/80.0 GiB", "0.4s", "7.2s", "memory", "device"):
        assert cell in text, cell
    assert "recent failures and dead letters" in text
    # the last line of a traceback says what went wrong
    assert "a1b2c3d4e5f6" in text and "ValueError: bad shape (3, 4)" in text
    assert "Traceback" not in text
    assert "ff00ff00" in text and "expired" in text
    assert "throughput" in text
    # the model catalogue: what each queue serves, with an old replica and a gone one
    assert "models" in text and "examples.embeddings:MiniLM" in text
    assert "2 (old)" in text and "h-9f8e" in text and "cpu, cuda:0" in text


def test_the_models_panel_gives_way_to_workers_and_failures() -> None:
    text = "\n".join(show(frame(history(models=MODELS * 10)), 160, 30))
    assert re.search(r"… \d+ more", text)  # cut short: the failures still show
    assert "recent failures and dead letters" in text and "a1b2c3d4e5f6" in text
    small = "\n".join(show(frame(), 100, 24))
    assert "gpu-node-01" in small  # the workers come first
    empty = "\n".join(show(frame(history(models=[])), 160, 50))
    assert "models" not in empty.replace("models served", "")


def test_throughput_is_the_succeeded_delta_over_the_time_between_snapshots() -> None:
    h = History()
    h.add(Snapshot(T0, queues(1000), []))
    assert h.rate("embed") is None and h.total_rate() is None
    assert list(h.totals) == []
    h.add(Snapshot(T0 + 2.0, queues(1300), []))
    assert h.rate("embed") == pytest.approx(150.0)   # 300 tasks in 2 s
    assert h.rate("chat-completions") == pytest.approx(75.0)
    assert h.total_rate() == pytest.approx(225.0)
    assert list(h.totals) == [pytest.approx(225.0)]
    assert h.rate("nope") is None
    row = next(x for x in show(render(h.last, h, url=URL), 160, 50) if x.startswith("embed"))
    assert "150.0" in row.split()
    # a purged queue starts again from zero: no negative rate
    h.add(Snapshot(T0 + 3.0, queues(10), []))
    assert h.rate("embed") == 0.0
    # a queue that was not in the previous snapshot has no rate yet
    h.add(Snapshot(T0 + 4.0, [*queues(20), QueueView(name="new", succeeded=99)], []))
    assert h.rate("new") is None
    assert h.total_rate() == pytest.approx(15.0)


def test_before_the_second_snapshot_rates_are_a_dash() -> None:
    h = history(1)
    row = next(x for x in show(frame(h), 160, 50) if x.startswith("embed"))
    assert row.split()[2] == DASH  # queue, waiting, tasks/s


def test_sparkline() -> None:
    assert sparkline([0, 1, 2, 3, 4, 5, 6, 7]) == BARS
    assert sparkline([5, 5, 5]) == BARS[-1] * 3
    assert sparkline([0, 0]) == BARS[0] * 2
    assert sparkline([]) == ""
    assert sparkline([7, 0, 7], width=2) == BARS[0] + BARS[-1]
    assert sparkline([1, 2], width=0) == ""
    h = history(100)
    assert len(h.totals) == 60  # one per refresh, the last ~60
    line = next(x for x in show(frame(h), 160, 50) if x.startswith("throughput"))
    assert BARS[-1] * 10 in line  # a steady rate is a row of full bars
    assert "150.0 tasks/s" in line


def test_80_columns_drop_the_least_important_columns() -> None:
    text = "\n".join(lines := show(frame(), 80, 24))
    assert "memory" not in text and "3.0/80.0 GiB" not in text
    assert "delayed" not in text and "streams" not in text
    for kept in ("queue", "waiting", "tasks/s", "running", "workers", "dead",
                 "gpu-node-01:4242", "running", "24/32", "210.5",
                 "a1b2c3d4e5f6", "dead", "recent failures"):
        assert kept in text, kept
    assert any(x.startswith("throughput") for x in lines)


def test_below_20_rows_only_the_queues_and_a_summary_line() -> None:
    for width, height in ((80, 19), (40, 10)):
        lines = show(frame(), width, height)
        text = "\n".join(lines)
        assert "embed" in text and "waiting" in text
        assert "state" not in text and "gpu-node" not in text  # no workers table
        assert not any(x.startswith(("throughput", "recent failures")) for x in lines)
        assert lines[-1].startswith("2 queues · 1234 waiting")


def test_20x5_still_shows_a_queue_and_the_summary() -> None:
    lines = show(frame(), 20, 5)
    assert lines[0].startswith("mtq dashboard")
    assert lines[-1].startswith("2 queues")
    assert any(x.startswith("chat-comp") for x in lines)


def test_a_long_list_ends_with_how_many_more() -> None:
    h = History()
    many = [QueueView(name=f"q{i:03}", waiting=i) for i in range(80)]
    h.add(Snapshot(T0, many, WORKERS * 20))
    text = "\n".join(show(render(h.last, h, url=URL), 120, 40))
    assert "q000" in text and "q079" not in text
    assert "more" in text


def test_unreachable_redis_shows_a_banner_over_the_last_snapshot() -> None:
    h = history()
    lines = show(frame(h, error="cannot reach Redis (Connection refused)"), 160, 50)
    assert lines[1].startswith("Redis unreachable; retrying")
    assert "Connection refused" in lines[1]
    assert any(x.startswith("embed") for x in lines)  # the last good figures stay
    lines = show(render(None, History(), url=URL, error="Connection refused"), 80, 24)
    assert "no snapshot yet" in lines[1]
    # the first frame before any snapshot, without an error
    lines = show(render(None, History(), url=URL), 80, 24)
    assert "waiting for the first snapshot" in lines[1]


def test_no_queues_and_no_workers() -> None:
    h = History()
    h.add(Snapshot(T0, [], []))
    text = "\n".join(show(render(h.last, h, url=URL), 100, 30))
    assert "no queues yet" in text and "workers: none" in text
    assert "recent failures and dead letters: none" in text
    lines = show(render(h.last, h, url=URL), 40, 8)
    assert lines[-1].startswith("0 queues")


def test_odd_worker_entries_do_not_break_the_frame() -> None:
    h = History()
    h.add(Snapshot(T0, queues(), [{"id": "x"}, {"host": "h", "memory": "?", "state": "weird",
                                                "heartbeat_age_s": 99.0, "tasks_per_s": None}]))
    text = "\n".join(show(render(h.last, h, url=URL), 160, 50))
    assert "weird" in text and "99.0s" in text


@pytest.mark.parametrize("error", [None, "cannot reach Redis"])
def test_every_size_fits(error: str | None) -> None:
    big = History()
    big.add(Snapshot(T0, [QueueView(name=f"queue-with-a-long-name-{i}", waiting=10**9,
                                    failures=queues()[1].failures * 3) for i in range(30)],
                     WORKERS * 15))
    big.add(Snapshot(T0 + 1, big.last.queues if big.last else [], WORKERS * 15))
    for h in (history(), big, History()):
        for width in (1, 5, 20, 33, 50, 80, 99, 100, 131, 200):
            for height in (1, 2, 5, 8, 19, 20, 21, 30, 60):
                show(render(h.last, h, url=URL, error=error), width, height)


def test_safe_url() -> None:
    assert safe_url("redis://:pw@h:1/0") == "redis://:***@h:1/0"
    assert safe_url("rediss://user:pw@h/0") == "rediss://user:***@h/0"
    assert safe_url("redis://h:6379/0") == "redis://h:6379/0"
    assert safe_url("unix:///tmp/r.sock?db=1") == "unix:///tmp/r.sock?db=1"
