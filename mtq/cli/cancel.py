"""``mtq cancel`` (one task) and ``mtq purge`` (every waiting task of a queue)."""

from __future__ import annotations

import sys

import click

from mtq.cli.common import (
    FAILED,
    NOT_FOUND,
    console,
    echo_json,
    err_console,
    fail,
    fail_on,
    json_option,
    open_queue,
    redis_option,
    require_known,
    running_server,
)
from mtq.errors import MtqError


@click.command()
@click.argument("task_id")
@click.option("--queue", "-q", default=None, help="Its queue (default: look in every queue).")
@redis_option
@json_option
def cancel(task_id: str, queue: str | None, url: str | None, as_json: bool) -> None:
    """Cancel a task: a waiting one at once; a running one is stopped by its worker
    (a generator at its next step). Exit 1 if it had already finished."""
    from mtq.admin import find_task
    from mtq.broker.codes import Code
    from mtq.broker.connection import connect

    url = running_server(url)
    try:
        t = find_task(connect(url), task_id, queue)
        code, before = t.queue.broker.cancel(t.id)
    except MtqError as exc:
        fail_on(exc)
    outcome = {1: "cancelled", 2: "cancel requested"}.get(code, "finished")
    if as_json:
        echo_json({"id": t.id, "queue": t.queue.name, "outcome": outcome, "was": before})
    elif code == 1:
        console.print(f"cancelled {t.id} (it was {before})")
    elif code == 2:
        console.print(f"cancel requested: {t.id} is running; its worker stops it")
    if code == Code.FINISHED:
        if not as_json:
            err_console.print(f"[yellow]{t.id} already {before}; nothing to cancel[/]")
        sys.exit(FAILED)
    if code == Code.NOT_FOUND:
        fail(f"no task {t.id!r}", NOT_FOUND)



@click.command()
@click.argument("queue")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@redis_option
@json_option
def purge(queue: str, yes: bool, url: str | None, as_json: bool) -> None:
    """Drop every waiting task of QUEUE (each ends cancelled, 'purged'). Running
    tasks, retries waiting for their delay and dead letters stay."""
    q = open_queue(queue, running_server(url))
    try:
        require_known(q.redis, queue)
        waiting = q.stats()["waiting"]
        if not yes:
            click.confirm(f"Drop the {waiting:,} waiting task(s) of {queue!r}?", abort=True,
                          err=True)
        n = q.purge()
    except MtqError as exc:
        fail_on(exc)
    if as_json:
        echo_json({"queue": queue, "purged": n})
    else:
        console.print(f"{n:,} waiting task(s) purged from {queue!r}")
