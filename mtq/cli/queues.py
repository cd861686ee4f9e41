"""``mtq queue``: a queue as a whole (delete it)."""

from __future__ import annotations

import click

from mtq.cli.common import (
    NOT_FOUND,
    console,
    echo_json,
    fail,
    fail_on,
    json_option,
    redis_option,
    running_server,
)
from mtq.errors import MtqError


@click.group("queue")
def queue_group() -> None:
    """A queue as a whole."""


@queue_group.command("delete")
@click.argument("queue")
@click.option("--force", is_flag=True,
              help="Delete it even while workers serve it (their running tasks are lost).")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@redis_option
@json_option
def delete(queue: str, force: bool, yes: bool, url: str | None, as_json: bool) -> None:
    """Delete QUEUE: every task (waiting, running, finished, dead), its streams,
    counters and timelines, and its row in 'mtq status'. Refused while workers serve
    it, unless --force. A later submit creates it anew."""
    from mtq.admin import queue_names
    from mtq.client import Queue

    try:
        q = Queue(queue, running_server(url))
        if queue not in queue_names(q.redis):
            fail(f"unknown queue {queue!r}: there is nothing to delete", NOT_FOUND)
        stats = q.stats()
        if not yes:
            click.confirm(
                f"Delete queue {queue!r} with its {stats.get('waiting', 0):,} waiting, "
                f"{stats.get('running', 0):,} running and {stats.get('dead', 0):,} dead "
                "task(s)?", abort=True, err=True)
        keys = q.delete(force=force)
    except MtqError as exc:
        fail_on(exc)
    if as_json:
        echo_json({"queue": queue, "deleted": True, "keys": keys})
    else:
        console.print(f"queue {queue!r} deleted ({keys:,} key(s))")
