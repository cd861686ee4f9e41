"""``mtq status`` (the queues, from one snapshot) and ``mtq task`` (one task and the
timeline of its life): thin over :mod:`mtq.admin`."""

from __future__ import annotations

import json
from typing import Any

import click
from rich.markup import escape
from rich.table import Table

from mtq.broker.tenants import DEFAULT_TOP, shown_tenant, top_rows
from mtq.cli.common import (
    console,
    echo_json,
    fail_on,
    json_option,
    millis,
    open_queue,
    printable,
    redis_option,
    require_known,
    running_server,
    shown,
    when,
)
from mtq.errors import MtqError


@click.command()
@click.argument("queue", required=False)
@click.option("--tenants", "by_tenant", is_flag=True,
              help="Scheduling per tenant and band instead: a table per queue.")
@click.option("--top", "top", type=click.IntRange(min=1), default=DEFAULT_TOP,
              show_default=True, help="With --tenants: rows shown per queue (busiest "
              "first), the rest summed in an 'other' row.")
@redis_option
@json_option
def status(queue: str | None, by_tenant: bool, top: int, url: str | None,
           as_json: bool) -> None:
    """The queues, from one cheap snapshot (its cost does not grow with the number
    of tasks).

    \b
    Columns (short, so that the table fits 80 columns):
      wait      tasks waiting
      strm      streams with waiting work
      run       tasks running
      retry     tasks waiting to be retried (after a failure, for their delay)
      dead      dead letters ('mtq dlq list')
      ok, fail  tasks succeeded, failed: totals since the queue began
      p50, p99  submit-to-finish latency in ms, of the last 1000 tasks
      wkrs      live worker processes
    Counts from 10,000 up are rounded: 12.3k, 4.6M; --json gives exact figures.

    \b
    --tenants: per queue with scheduling on, a row per tenant and band, busiest
    (waiting + running, then cost served) first, the --top N and an 'other' row:
      wait, wcost  tasks waiting, their estimated cost
      run          tasks running
      served       cost served (charged at claim, settled with the reported cost)
      held         times a claim passed the tenant over for its rate limit (hold)
      refused      tasks refused at submit (rate limit, deadline)
    """
    from dataclasses import asdict

    from mtq.admin import snapshot
    from mtq.broker.connection import connect

    url = running_server(url)
    try:
        client = connect(url)
        if queue is not None:
            open_queue(queue, url)  # checks the name
            require_known(client, queue)
        snap = snapshot(client, [queue] if queue else None)
    except MtqError as exc:
        fail_on(exc)
    if by_tenant:
        tenants_out(snap, top, as_json)
        return
    if as_json:
        echo_json({"ts": snap.ts, "queues": [asdict(q) for q in snap.queues]})
        return
    if not snap.queues:
        console.print("no queues yet: submit a task ('mtq submit QUEUE PAYLOAD')")
        return
    console.print(status_table(snap.queues))
    console.print(STATUS_LEGEND, style="dim", highlight=False)


#: ``mtq status``'s columns after the queue's name, four or five letters each so that a
#: queue name of up to about 24 characters fits 80 columns (explained in its help and
#: in the legend printed under the table)
STATUS_COLUMNS = ("wait", "strm", "run", "retry", "dead", "ok", "fail", "p50", "p99", "wkrs")
STATUS_LEGEND = ("wait, run: tasks waiting, running · strm: streams with work · retry: to be "
                 "retried · ok, fail: totals · p50, p99: latency in ms · wkrs: workers")


def compact_count(n: int) -> str:
    """A count in at most 5 characters: 9,999, then 12.3k, 456k, 1.2M ..."""
    if n < 10_000:
        return f"{n:,}"
    for scale, unit in ((1e3, "k"), (1e6, "M"), (1e9, "G"), (1e12, "T")):
        v = n / scale
        if v < 99.95:
            return f"{v:.1f}{unit}"
        if v < 999.5:
            return f"{v:.0f}{unit}"
    return f"{n / 1e15:.0f}P"


def status_table(queues: list[Any]) -> Table:
    """The queues as a borderless table that fits 80 columns: short headers, two
    spaces between columns, counts of at most 5 characters; a queue name too long
    for what is left wraps onto a second line rather than being cut."""
    from rich import box

    table = Table(title=f"{len(queues)} queue{'s' if len(queues) != 1 else ''}",
                  title_justify="left", box=box.SIMPLE_HEAD, show_edge=False,
                  pad_edge=False, padding=(0, 0, 0, 1))
    table.add_column("queue", overflow="fold")
    for col in STATUS_COLUMNS:
        table.add_column(col, justify="right", no_wrap=True)
    for v in queues:
        n = compact_count
        table.add_row(escape(v.name), n(v.waiting), n(v.streams), n(v.running), n(v.delayed),
                      n(v.dead), n(v.succeeded), n(v.failed), millis(v.p50_ms),
                      millis(v.p99_ms), n(v.workers))
    return table


def tenants_out(snap: Any, top: int, as_json: bool) -> None:
    """``mtq status --tenants``: each queue's top rows and 'other' (see its help)."""
    from dataclasses import asdict

    if as_json:
        echo_json({"ts": snap.ts, "queues": [
            {"queue": q.name, "scheduling": bool(q.tenants), "top": top,
             "tenants": [asdict(r) for r in top_rows(q.tenants, top)]}
            for q in snap.queues]})
        return
    if not snap.queues:
        console.print("no queues yet: submit a task ('mtq submit QUEUE PAYLOAD')")
        return
    for q in snap.queues:
        if not q.tenants:
            console.print(f"{escape(q.name)}: no scheduling (no task with a priority or a "
                          "tenant yet)", style="dim", highlight=False)
            continue
        console.print(tenants_table(q.name, top_rows(q.tenants, top), len(q.tenants)))
    console.print(TENANTS_LEGEND, style="dim", highlight=False)


TENANTS_COLUMNS = ("band", "wait", "wcost", "run", "served", "held", "refused")
TENANTS_LEGEND = ("wait, run: tasks waiting, running · wcost: their cost · served: cost "
                  "served · held: passed over for a rate limit · refused: at submit")


def tenants_table(queue: str, rows: list[Any], lanes: int) -> Table:
    """One queue's tenant rows (tenant '' shown as (none), 'other (N)' summing N rows)."""
    from rich import box

    table = Table(title=f"{queue}: {lanes} tenant/band row{'s' if lanes != 1 else ''}",
                  title_justify="left", box=box.SIMPLE_HEAD, show_edge=False,
                  pad_edge=False, padding=(0, 0, 0, 1))
    table.add_column("tenant", overflow="fold")
    for col in TENANTS_COLUMNS:
        table.add_column(col, justify="left" if col == "band" else "right", no_wrap=True)
    n = compact_count
    for r in rows:
        table.add_row(escape(shown_tenant(r)), r.band or "all", n(r.waiting),
                      n(round(r.waiting_cost)), n(r.running), n(round(r.served_cost)),
                      n(r.held), n(r.refused))
    return table


# -- task ------------------------------------------------------------------------------
@click.command()
@click.argument("task_id")
@click.option("--queue", "-q", default=None, help="Its queue (default: look in every queue).")
@redis_option
@json_option
def task(task_id: str, queue: str | None, url: str | None, as_json: bool) -> None:
    """Details of a task and the timeline of its life."""
    from dataclasses import asdict

    from mtq.admin import find_task
    from mtq.broker.connection import connect

    url = running_server(url)
    try:
        t = find_task(connect(url), task_id, queue)
        info = t.info()
        trace = t.trace()
        result = t.result(timeout=0) if info.status == "succeeded" else None
        chain = t.chain()
        steps = chain.steps() if chain is not None else []
        chained = {"id": chain.id, "status": chain.status(steps),
                   "steps": [asdict(s) for s in steps]} if chain is not None else None
    except MtqError as exc:
        fail_on(exc)
    if as_json:
        echo_json({**asdict(info), "queue": t.queue.name, "result": result,
                   "timeline": [asdict(e) for e in trace], "chain": chained})
        return
    table = Table(title=f"task {t.id}", show_header=False)
    table.add_row("queue", t.queue.name)
    style = {"succeeded": "green", "failed": "red", "dead": "red", "running": "yellow"}
    table.add_row("status", f"[{style.get(info.status, 'white')}]{info.status}[/]")
    table.add_row("stream", info.stream or "-")
    table.add_row("attempts / deliveries", f"{info.attempts} / {info.deliveries}")
    table.add_row("created / started / finished",
                  f"{when(info.created)} / {when(info.started)} / {when(info.finished)}")
    if info.due is not None:
        table.add_row("due (delayed)", when(info.due))
    if info.deadline is not None:
        table.add_row("start by (ttl, deadline)", when(info.deadline))
    if info.timeout is not None:
        table.add_row("run timeout", f"{info.timeout:g} s")
    if info.worker:
        table.add_row("worker", shown(info.worker))
    if info.error:
        table.add_row("error", shown(info.error))
    if info.cancel_requested:
        table.add_row("cancel", "requested")
    if result is not None:
        text = json.dumps(result, default=repr, ensure_ascii=False)
        table.add_row("result", shown(text if len(text) <= 300 else text[:300] + " ..."))
    console.print(table)
    if chained is not None:
        _chain_table(chained)
    timeline = Table(title="timeline")
    for col in ("time", "+ms", "event", "detail"):
        timeline.add_column(col)
    first = trace[0].ts if trace else 0.0
    for e in trace:
        timeline.add_row(when(e.ts * 1000), f"{(e.ts - first) * 1000:.0f}", e.kind,
                         shown(e.detail))
    console.print(timeline)
    if info.traceback:
        console.print("traceback (the last exception its handler raised):")
        console.print(printable(info.traceback), markup=False, highlight=False,
                      soft_wrap=True)


def _chain_table(chained: dict[str, Any]) -> None:
    """Every step of the chain a task is a step of (``pending``: not submitted yet)."""
    style = {"succeeded": "green", "failed": "red", "dead": "red", "running": "yellow",
             "cancelled": "red", "expired": "red"}
    t = Table(title=f"chain {chained['id']} ({chained['status']})")
    for col in ("step", "queue", "task", "status", "error"):
        t.add_column(col)
    for s in chained["steps"]:
        t.add_row(str(s["step"]), escape(s["queue"]), s["id"],
                  f"[{style.get(s['status'], 'white')}]{s['status']}[/]",
                  shown(s["error"] or "-"))
    console.print(t)
