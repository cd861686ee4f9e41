"""Collecting many results: ``submit_many`` of N no-op tasks, then every result, with one
warm ``mtq worker run`` (batch 64): ``result()`` on each task in a loop (outcomes the
client's inbox already holds cost no round trip); the same loop with the inbox off
(``INBOX_MAX = 0``: a read per task, the baseline); a ``Group``'s ``submit_many`` then
``results()``; and the worker's own drain rate in the same pass, the ceiling. Passes of
the modes alternate; medians.

    python -m benchmarks.collect           # full run, writes the collect block
    python -m benchmarks.collect --quick   # smaller, prints only
"""

from __future__ import annotations

import time
from collections.abc import Callable

import redis

import mtq
from benchmarks.harness.meters import machine_info, median
from benchmarks.harness.report import cli_args, write_block
from benchmarks.harness.server import Server, compile_tree
from benchmarks.hotpath import spawn_worker, wait_worker, worker_env
from mtq import replies


def commands(r: redis.Redis) -> int:
    return sum(v["calls"] for k, v in r.info("commandstats").items() if k != "cmdstat_info")


def loop(q: mtq.Queue, items: list[dict[str, int]]) -> None:
    for t in q.submit_many(items):
        t.result(timeout=120)


def group(q: mtq.Queue, items: list[dict[str, int]]) -> None:
    g = mtq.Group(q)
    g.submit_many(items)
    g.results(timeout=120)


def one_pass(server: Server, mode: str, n: int) -> dict[str, float]:
    """One pass of ``mode`` on a fresh queue and client with a warm worker."""
    r = redis.Redis.from_url(server.url)
    name = f"collect-{len(mode)}-{time.monotonic_ns()}"
    q = mtq.Queue(name, client=r)
    proc = spawn_worker(server, name, "benchmarks.children.noop:handle", None, worker_env(server))
    saved = replies.INBOX_MAX
    try:
        wait_worker(r, name, proc)
        q.submit({"warm": 1}).result(timeout=60)
        items = [{"i": i} for i in range(n)]
        run: Callable[[mtq.Queue, list[dict[str, int]]], None] = group if mode == "group" \
            else loop
        if mode == "loop, inbox off":
            replies.INBOX_MAX = 0
        c0 = commands(r)
        t0 = time.perf_counter()
        run(q, items)
        elapsed = time.perf_counter() - t0
        c1 = commands(r)
        rows = r.eval(
            "local lo, hi = nil, 0 for _, k in ipairs(redis.call('KEYS', ARGV[1])) do "
            "local f = redis.call('HMGET', k, 'started', 'finished') "
            "if f[1] and f[2] then local s, e = tonumber(f[1]), tonumber(f[2]) "
            "if not lo or s < lo then lo = s end if e > hi then hi = e end end end "
            "return {lo, hi}", 0, q.broker.keys.task("*"))
        drain_s = (int(rows[1]) - int(rows[0])) / 1000
    finally:
        replies.INBOX_MAX = saved
        proc.terminate()
        proc.wait(30)
        replies.hub_of(r).close_all()
        r.flushdb()
        r.close()
    return {"rate": n / elapsed, "drain": (n + 1) / drain_s if drain_s > 0 else 0.0,
            "cmds": (c1 - c0) / n}


MODES = ("loop", "loop, inbox off", "group")


def main(argv: list[str] | None = None) -> None:
    quick, docs = cli_args(argv, __doc__, "~30 s")
    n, passes = (5000, 1) if quick else (20000, 3)
    compile_tree()
    server = Server()
    server.start()
    out: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    try:
        version = redis.Redis.from_url(server.url).info("server")["redis_version"]
        for i in range(passes):
            for mode in (MODES if i % 2 == 0 else MODES[::-1]):
                out[mode].append(one_pass(server, mode, n))
    finally:
        server.stop()

    def med(mode: str, k: str) -> float:
        return median([p[k] for p in out[mode]])

    base = med("loop, inbox off", "rate")
    lines = [
        "| mode | end to end (tasks/s) | vs the loop with the inbox off | the worker's drain in "
        "the same pass (tasks/s) | Redis commands per task |",
        "|---|---|---|---|---|",
    ]
    for mode, label in (("loop", "`result()` on each task, in a loop"),
                        ("loop, inbox off", "the same loop, inbox off (a read per task)"),
                        ("group", "`Group.submit_many` then `results()`")):
        lines.append(f"| {label} | {med(mode, 'rate'):,.0f} | "
                     f"{med(mode, 'rate') / base:.2f}x | {med(mode, 'drain'):,.0f} | "
                     f"{med(mode, 'cmds'):.2f} |")
    print("\n".join(lines))
    if docs is not None:
        write_block("collect", lines, "python -m benchmarks.collect",
                    machine_info(None, f"redis-server {version}", "not pinned"), path=docs)


if __name__ == "__main__":
    main()
