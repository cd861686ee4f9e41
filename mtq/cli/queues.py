"""``mtq queue``: a queue as a whole: its settings, stored in Redis for every
producer and worker (``config``), and deleting it."""

from __future__ import annotations

import dataclasses
from typing import Any

import click
from rich.table import Table

from mtq.cli.common import (
    NOT_FOUND,
    USAGE,
    console,
    echo_json,
    fail,
    fail_on,
    json_option,
    redis_option,
    running_server,
)
from mtq.errors import MtqError
from mtq.settings import QUEUE_SETTING_DOCS, QueueSettings


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


@queue_group.command("config")
@click.argument("queue")
@click.argument("pairs", nargs=-1, metavar="[KEY VALUE]...")
@click.option("--reset", multiple=True, metavar="KEY",
              help="Forget a stored setting: back to its default (repeatable).")
@redis_option
@json_option
def config(queue: str, pairs: tuple[str, ...], reset: tuple[str, ...], url: str | None,
           as_json: bool) -> None:
    """Show QUEUE's settings, or set some of them:

    \b
    mtq queue config chat
    mtq queue config chat max_retries 5 lease_ms 20000
    mtq queue config chat --reset lease_ms

    They are stored in Redis: every producer and worker of the queue uses them
    (each reads them again within 10 s); a value given in code or on a worker's
    command line wins for that process. Every key, with its unit and default, is
    in docs/cli.md. A bad key or value changes nothing (exit 2)."""
    from mtq.broker import config as stored_config
    from mtq.broker.connection import connect
    from mtq.validation import check_queue_name

    if len(pairs) % 2:
        fail(f"give KEY VALUE pairs; {pairs[-1]!r} has no value", USAGE)
    changes = dict(zip(pairs[::2], pairs[1::2]))
    try:
        check_queue_name(queue)
        client = connect(running_server(url))
        if changes or reset:
            stored_config.store(client, queue, changes, reset)
        stored = stored_config.read(client, queue)
    except MtqError as exc:
        fail_on(exc)
    current = dataclasses.asdict(QueueSettings.from_dict(stored))
    defaults = dataclasses.asdict(QueueSettings())
    if as_json:
        echo_json({"queue": queue, "settings": current, "stored": stored})
        return
    table = Table(title=f"settings of queue {queue!r} (* stored; the rest are defaults)")
    for col in ("key", "value", "default", "unit"):
        table.add_column(col)
    for name, value in current.items():
        mark = "*" if name in stored else ""
        table.add_row(f"{name}{mark}", _shown(value), _shown(defaults[name]),
                      QUEUE_SETTING_DOCS[name][0])
    console.print(table)


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value or "(none)"
    return f"{value:,g}" if isinstance(value, float) else f"{value:,}"
