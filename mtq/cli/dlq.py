"""``mtq dlq list|retry|purge``: the dead letters of a queue."""

from __future__ import annotations

import sys

import click
from rich.table import Table

from mtq.cli.common import (
    NOT_FOUND,
    USAGE,
    console,
    echo_json,
    err_console,
    fail,
    fail_on,
    json_option,
    open_queue,
    printable,
    redis_option,
    require_known,
    running_server,
    shown,
    when,
)
from mtq.errors import MtqError


@click.group()
def dlq() -> None:
    """Dead letters: tasks that failed on every retry or killed their workers."""


@dlq.command("list")
@click.argument("queue")
@click.option("--count", "-n", default=20, show_default=True, type=click.IntRange(1, 10_000))
@click.option("--verbose", "-v", is_flag=True,
              help="Each dead letter's whole error and traceback, after the table.")
@redis_option
@json_option
def dlq_list(queue: str, count: int, verbose: bool, url: str | None, as_json: bool) -> None:
    """The newest dead letters of QUEUE, with their errors (--json: tracebacks too)."""
    q = open_queue(queue, running_server(url))
    try:
        require_known(q.redis, queue)
        rows = q.dead_letters(0, count)
        total = q.stats()["dead"]
    except MtqError as exc:
        fail_on(exc)
    if as_json:
        echo_json({"queue": queue, "dead": total, "tasks": rows})
        return
    table = Table(title=f"{total} dead letter(s) in {queue!r}"
                  + (f", newest {len(rows)}" if total > len(rows) else ""))
    for col in ("id", "stream", "attempts", "deliveries", "died", "error"):
        table.add_column(col)
    for row in rows:
        table.add_row(row["id"], row["stream"] or "-", str(row["attempts"]),
                      str(row["deliveries"]), when(row["finished"]),
                      shown((row["error"] or "")[:120]))
    console.print(table)
    if verbose:
        for row in rows:
            console.print(printable(f"\n{row['id']}: {row['error'] or '-'}"), markup=False,
                          highlight=False, soft_wrap=True)
            console.print(printable(row["traceback"] or "(no traceback: the task killed its "
                                    "process or its lease ran out)"), markup=False,
                          highlight=False, soft_wrap=True)


def _dlq_action(action: str, queue: str, ids: tuple[str, ...], all_: bool, url: str | None,
                as_json: bool) -> None:
    if bool(ids) == all_:
        fail(f"name the ids to {action}, or --all", USAGE)
    q = open_queue(queue, running_server(url))
    try:
        require_known(q.redis, queue)
        n = q.retry_dead(ids or None) if action == "retry" else q.purge_dead(ids or None)
    except MtqError as exc:
        fail_on(exc)
    if as_json:
        echo_json({"queue": queue, action: n})
    else:
        verb = "queued again" if action == "retry" else "deleted"
        console.print(f"{n} dead letter(s) {verb}")
    if ids and n < len(ids):
        err_console.print(f"[yellow]{len(ids) - n} id(s) were not dead letters of {queue!r}[/]")
        sys.exit(NOT_FOUND)


@dlq.command("retry")
@click.argument("queue")
@click.argument("ids", nargs=-1)
@click.option("--all", "all_", is_flag=True, help="Every dead letter of the queue.")
@redis_option
@json_option
def dlq_retry(queue: str, ids: tuple[str, ...], all_: bool, url: str | None,
              as_json: bool) -> None:
    """Queue dead letters again (each at the tail of its stream, attempts reset)."""
    _dlq_action("retry", queue, ids, all_, url, as_json)


@dlq.command("purge")
@click.argument("queue")
@click.argument("ids", nargs=-1)
@click.option("--all", "all_", is_flag=True, help="Every dead letter of the queue.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@redis_option
@json_option
def dlq_purge(queue: str, ids: tuple[str, ...], all_: bool, yes: bool, url: str | None,
              as_json: bool) -> None:
    """Delete dead letters for good."""
    if all_ and not yes:
        click.confirm(f"Delete every dead letter of {queue!r}?", abort=True, err=True)
    _dlq_action("purge", queue, ids, all_, url, as_json)
