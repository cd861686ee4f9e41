"""``mtq models``: the model catalogue (which targets and versions each queue serves,
where, since when) and its reload history. Thin over :mod:`mtq.broker.catalogue`."""

from __future__ import annotations

import json
from typing import Any

import click
from rich.table import Table

from mtq.cli.common import (
    NOT_FOUND,
    console,
    echo_json,
    fail,
    fail_on,
    json_option,
    printable,
    redis_option,
    running_server,
    when,
)
from mtq.errors import MtqError


def catalogue(client: Any, queue: str | None, history_n: int) -> dict[str, Any]:
    """What ``mtq models`` shows: {"models": [one row per (queue, model, version)
    served], "history": [newest first]}. A queue's recorded model with no live
    worker has a row with 0 replicas."""
    from mtq.admin import queue_names
    from mtq.broker import catalogue as cat
    from mtq.broker.registry import list_workers

    workers = list_workers(client, queue)
    names = sorted(set(queue_names(client)) | {str(w["queue"]) for w in workers if w.get("queue")})
    if queue is not None:
        names = [queue]
    rows = cat.served(workers, cat.models(client, names))
    return {"models": rows, "history": cat.history(client, history_n, queue)}


def _options(options: dict[str, Any]) -> str:
    """``key=value ...`` as given with --set (true/false/none for those values)."""
    def text(v: Any) -> str:
        return v if isinstance(v, str) else "none" if v is None else json.dumps(v)

    return " ".join(f"{k}={text(v)}" for k, v in options.items()) or "-"


@click.command("models")
@click.option("-q", "--queue", default=None, help="Only this queue.")
@click.option("--history", "history_n", default=10, show_default=True,
              type=click.IntRange(0, 1000), help="Reload history records to show.")
@json_option
@redis_option
def models(queue: str | None, history_n: int, as_json: bool, url: str | None) -> None:
    """Which targets and versions are served on which queues: hosts, devices, replicas
    (live workers), when loaded; and the history of loads and reloads (kept after the
    workers stop). A --queue Redis knows nothing of exits 3."""
    from mtq.admin import queue_names
    from mtq.broker import catalogue as cat
    from mtq.broker.connection import connect
    from mtq.validation import check_queue_name

    try:
        if queue is not None:
            check_queue_name(queue)
        client = connect(running_server(url))
        if queue is not None and queue not in queue_names(client) and \
                not cat.models(client, [queue]) and not cat.history(client, 1, queue):
            fail(f"unknown queue {queue!r}: no task was submitted to it and no worker "
                 "served it", NOT_FOUND)
        data = catalogue(client, queue, history_n)
    except MtqError as exc:
        fail_on(exc)
    if as_json:
        echo_json(data)
        return
    table = Table(title="models served")
    for col in ("queue", "target / model", "version", "kind", "options", "replicas", "hosts",
                "devices", "loaded"):
        table.add_column(col)
    for row in data["models"]:
        table.add_row(printable(row["queue"]), printable(str(row["target"] or row["model"])),
                      printable(str(row["version"])) + ("" if row["current"] else " (old)"),
                      str(row["kind"] or "-"),
                      printable(_options(row["options"])),
                      str(row["replicas"]),
                      printable(", ".join(map(str, row["hosts"]))),
                      printable(", ".join(row["devices"])), when(row["loaded"]))
    console.print(table)
    if history_n and data["history"]:
        hist = Table(title="history (newest first)")
        for col in ("time", "queue", "event", "target", "version", "host", "pid", "device",
                    "worker"):
            hist.add_column(col)
        for h in data["history"]:
            hist.add_row(when(h.get("ts")), printable(str(h.get("queue"))),
                         str(h.get("event")), printable(str(h.get("target"))),
                         printable(str(h.get("version"))), printable(str(h.get("host"))),
                         str(h.get("pid")), str(h.get("device")), str(h.get("worker")))
        console.print(hist)
