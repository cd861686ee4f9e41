"""``mtq models``: the model catalogue (which targets and versions each queue serves,
where, since when), the engines of each worker process, and the reload history.
Thin over :mod:`mtq.broker.catalogue` and the worker registry."""

from __future__ import annotations

import json
from typing import Any

import click
from rich.table import Table

from mtq.cli.common import (
    NOT_FOUND,
    ago,
    console,
    echo_json,
    fail,
    fail_on,
    held_memory,
    json_option,
    printable,
    redis_option,
    running_server,
    shown,
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
    return {"models": rows, "processes": processes(workers),
            "history": cat.history(client, history_n, queue)}


#: what ``mtq models`` shows of each engine of a process (registry fields)
ENGINE_FIELDS = ("queue", "worker", "engine", "state", "device", "model", "memory_bytes",
                 "last_used", "load_s", "on_demand", "idle_unload_s")


def processes(workers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The live worker processes and the engines each runs (one registry entry per
    engine, grouped by its ``process``, "host:pid"), sorted by process: which models
    are loaded where, their memory and last use."""
    out: dict[str, dict[str, Any]] = {}
    for w in workers:
        name = str(w.get("process") or f"{w.get('host')}:{w.get('pid')}")
        proc = out.setdefault(name, {"process": name, "host": w.get("host"),
                                     "pid": w.get("pid"), "supervisor": w.get("supervisor"),
                                     "engines": []})
        proc["engines"].append({k: w.get("id") if k == "worker" else w.get(k)
                                for k in ENGINE_FIELDS})
    for proc in out.values():
        proc["engines"].sort(key=lambda e: (str(e["queue"]), str(e["worker"])))
    return [out[k] for k in sorted(out)]


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
    (live workers), when loaded; the engines of each process (host:pid): loaded or
    not, their memory and last use; and the history of loads and reloads (kept after
    the workers stop). A --queue Redis knows nothing of exits 3."""
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
    if data["processes"]:
        procs = Table(title="engines by process")
        for col in ("process", "queue", "worker", "engine", "memory", "last used", "load",
                    "on demand"):
            procs.add_column(col)
        for proc in data["processes"]:
            for i, e in enumerate(proc["engines"]):
                load_s = e.get("load_s")
                idle = e.get("idle_unload_s")
                demand = ("yes" if e.get("on_demand") else "no") + \
                    (f", idle unload {idle:g} s" if isinstance(idle, (int, float))
                     and not isinstance(idle, bool) else "")
                procs.add_row(shown(proc["process"]) if i == 0 else "", shown(e["queue"]),
                              shown(e["worker"]), shown(e.get("engine") or "-"),
                              held_memory(e), ago(e.get("last_used")),
                              f"{load_s:.1f} s" if isinstance(load_s, (int, float))
                              and not isinstance(load_s, bool) else "-",
                              shown(demand) if e.get("on_demand") is not None else "-")
        console.print(procs)
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
