"""``mtq schedule add|list|remove|run``: periodic tasks (:mod:`mtq.client.schedules`,
run by :mod:`mtq.workers.scheduler`)."""

from __future__ import annotations

import json
import signal
from datetime import datetime

import click

from mtq.cli.common import (
    NOT_FOUND,
    USAGE,
    connect_client,
    console,
    echo_json,
    fail,
    fail_on,
    json_option,
    printable,
    redis_option,
    shown,
)
from mtq.errors import MtqError


@click.group()
def schedule() -> None:
    """Schedules: a task submitted to a queue at each occurrence of a cron expression,
    run by one leader among any number of 'mtq schedule run' (and 'mtq workers start')
    processes, each occurrence once."""


def _stamp(ts: float | None, tz: str = "UTC") -> str:
    if not ts:
        return "-"
    from zoneinfo import ZoneInfo

    return datetime.fromtimestamp(ts, ZoneInfo(tz)).strftime("%Y-%m-%d %H:%M:%S %Z")


@schedule.command("add")
@click.argument("queue")
@click.argument("cron")
@click.argument("payload")
@click.option("--stream", default=None, help="The stream its tasks go to (ordered).")
@click.option("--tenant", default=None, help="The tenant its tasks are queued under.")
@click.option("--tz", "tz", default="UTC", show_default=True,
              help="The IANA time zone the cron expression is read in (Europe/Paris).")
@click.option("--catch-up", "catch_up", type=click.Choice(["all", "latest", "none"]),
              default="latest", show_default=True,
              help="Occurrences missed while no scheduler ran: submit all (at most 1000), "
                   "the latest only, or none.")
@click.option("--name", default=None,
              help="The schedule's name (default: QUEUE-<8 hex digits>).")
@redis_option
@json_option
def schedule_add(queue: str, cron: str, payload: str, stream: str | None,
                 tenant: str | None, tz: str, catch_up: str, name: str | None,
                 url: str | None, as_json: bool) -> None:
    """Submit PAYLOAD (JSON) to QUEUE at each occurrence of CRON: five fields (minute
    hour day month weekday) or six with seconds last ('* * * * * */10': every 10 s).
    Exit code 2, adding nothing, for a bad expression, zone, name or payload."""
    import secrets

    from mtq.client import schedules as api

    try:
        value = json.loads(payload)
    except ValueError as exc:
        fail(f"PAYLOAD must be JSON (quote a string: '\"text\"'): {exc}", USAGE)
    if name is None:
        name = f"{queue}-{secrets.token_hex(4)}".replace(".", "-")[-40:].lstrip("-_")
    client = connect_client(url, start=True)
    try:
        s = api.add(client, name, queue, cron, value, stream=stream, tenant=tenant, tz=tz,
                    catch_up=catch_up)
    except MtqError as exc:
        fail_on(exc)
    if as_json:
        echo_json(s.as_dict())
        return
    first = s.next_after(s.created)
    click.echo(f"schedule {s.name}: {s.queue} at '{s.cron}' ({s.tz}), first "
               f"{_stamp(first, s.tz)}; runs while a scheduler runs ('mtq schedule run' or "
               f"'mtq workers start')")


@schedule.command("list")
@click.argument("queue", required=False)
@redis_option
@json_option
def schedule_list(queue: str | None, url: str | None, as_json: bool) -> None:
    """The schedules (of QUEUE if given), by name, with their next occurrence."""
    import time

    from rich.table import Table

    from mtq.client import schedules as api

    client = connect_client(url, start=False)
    try:
        rows = api.list_schedules(client, queue)
        cursors = api.cursors(client)
    except MtqError as exc:
        fail_on(exc)
    now = time.time()
    if as_json:
        echo_json([{**s.as_dict(), "last": cursors.get(s.name),
                    "next": s.next_after(now)} for s in rows])
        return
    if not rows:
        console.print("no schedules" + (f" of queue {shown(queue)}" if queue else "")
                      + "; add one with 'mtq schedule add Q CRON PAYLOAD'")
        return
    table = Table(title=f"{len(rows)} schedule(s)")
    for col in ("name", "queue", "cron", "tz", "catch-up", "stream", "tenant", "next",
                "payload"):
        table.add_column(col, no_wrap=col in ("name", "queue", "cron"))
    for s in rows:
        table.add_row(shown(s.name), shown(s.queue), printable(s.cron), s.tz, s.catch_up,
                      shown(s.stream) if s.stream else "-",
                      shown(s.tenant) if s.tenant else "-",
                      _stamp(s.next_after(now), s.tz),
                      printable(json.dumps(s.payload)[:60]))
    console.print(table)


@schedule.command("remove")
@click.argument("name")
@redis_option
def schedule_remove(name: str, url: str | None) -> None:
    """Remove the schedule NAME (its tasks already submitted stay). Exit code 3 if
    there is none."""
    from mtq.client import schedules as api

    client = connect_client(url, start=False)
    try:
        found = api.remove(client, name)
    except MtqError as exc:
        fail_on(exc)
    if not found:
        fail(f"no schedule named {name!r} (see 'mtq schedule list')", NOT_FOUND)
    click.echo(f"removed {printable(name)}")


@schedule.command("run")
@click.option("--lease-ms", type=click.IntRange(200, 3_600_000), default=10_000,
              show_default=True,
              help="The leader's lease: a killed leader's schedules resume within it.")
@redis_option
def schedule_run(lease_ms: int, url: str | None) -> None:
    """Run the schedules until SIGINT or SIGTERM: one leader among every 'mtq schedule
    run' and 'mtq workers start' on this Redis; the others take over within the
    lease if it dies."""
    from mtq.workers.scheduler import Scheduler

    client = connect_client(url, start=True)
    s = Scheduler(client=client, lease_ms=lease_ms)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: s.stop())
    click.echo(f"scheduler {s.token} running (lease {lease_ms} ms)", err=True)
    s.run()
