"""Running work under control: one section per measured figure.

* ``stop``: ``mtq workers start ... --replicas 5`` with five tasks running and its
  redis-server stopped; the time from the second SIGTERM to the supervisor's exit (a
  forced stop), and from a single SIGTERM (a graceful stop, which waits at most one
  lease for Redis, then goes on as a forced stop; ``--lease-ms 2000`` here).

Each section is a function ``measure_<name>(quick) -> dict`` whose ``"rows"`` are the
block's rows; ``main`` runs the sections asked for (``--only NAME``, repeatable; all
by default) and writes the ``bench:control`` block of docs/benchmarks.md when it ran
them all.

    python -m benchmarks.control                  # every section, writes the block
    python -m benchmarks.control --only stop      # one section, prints only
    python -m benchmarks.control --quick          # smaller, prints only
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

import mtq
from benchmarks.harness.meters import machine_info
from benchmarks.harness.procs import kill_group, spawn, worker_env
from benchmarks.harness.report import Results, cli_parser, docs_of, write_block
from benchmarks.harness.server import RedisServer, uniq
from mtq.replies import hub_of
from mtq.workers.registry import list_workers

REPLICAS = 5
LEASE_MS = 2000


def _wait(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.02)


def _one_stop(tmp: Path, signals: int) -> float:
    """Seconds from the last of ``signals`` SIGTERMs to the supervisor's exit, with five
    tasks running and Redis stopped just before."""
    server = RedisServer()
    server.start()
    queue = uniq("stop")  # and a log of its own: "stopping" must be this run's
    mark, log = tmp / f"{queue}.mark", tmp / f"{queue}.log"
    sup = spawn(["workers", "start", "benchmarks.children.held:hold", "--queue", queue,
                 "--replicas", str(REPLICAS), "--max-batch-size", "1", "--standby", "0",
                 "--lease-ms", str(LEASE_MS), "--redis", server.url],
                worker_env(server.url, MTQ_BENCH_MARK=str(mark)), log=log)
    try:
        r = redis.Redis.from_url(server.url)
        _wait(lambda: len(list_workers(r, queue)) == REPLICAS, 60, "the workers")
        q = mtq.Queue(queue, client=r, lease_ms=LEASE_MS)
        q.submit_many([{"s": 600} for _ in range(2 * REPLICAS)])
        hub_of(r).close_all()  # its reply listener would reconnect, on this CPU
        _wait(lambda: mark.exists() and len(set(mark.read_text().split())) == REPLICAS, 60,
              "a task running in every worker")
        r.close()
        server.stop()
        sup.send_signal(signal.SIGTERM)
        if signals == 2:
            _wait(lambda: b"stopping" in log.read_bytes(), 10, "the first signal seen")
            sup.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        try:
            sup.wait(120)
        except subprocess.TimeoutExpired:
            raise SystemExit(f"the supervisor did not stop in 120 s:\n{log.read_text()}"
                             ) from None
        took = time.monotonic() - t0
        if signals == 2 and took > 2:  # over the target: what the supervisor said
            print(f"a stop took {took:.2f} s; the supervisor's log ends:\n"
                  f"{log.read_text(errors='replace')[-2000:]}")
        return took
    finally:
        kill_group(sup)
        server.stop()


def measure_stop(quick: bool = False) -> dict[str, Any]:
    """The forced and the graceful stop's time with Redis away (seconds)."""
    runs = 1 if quick else 5
    with tempfile.TemporaryDirectory(prefix="mtq-bench-stop-") as d:
        forced = [_one_stop(Path(d), 2) for _ in range(runs)]
        graceful = [_one_stop(Path(d), 1) for _ in range(max(1, runs // 2))]
    runs_f = ", ".join(f"{x:.2f}" for x in forced)
    runs_g = ", ".join(f"{x:.2f}" for x in graceful)
    return {
        "forced_s": forced, "graceful_s": graceful,
        "rows": [
            (f"forced stop with Redis away, {REPLICAS} replicas busy: second SIGTERM to "
             f"exit, median of {runs}", statistics.median(forced), "s",
             f"target <= 2 s; runs {runs_f}"),
            (f"graceful stop with Redis away (--lease-ms {LEASE_MS}): SIGTERM to exit, "
             f"median of {len(graceful)}", statistics.median(graceful), "s",
             f"bound: found away at the signal (1 s checks), one lease, then a forced stop; "
             f"runs {runs_g}"),
        ],
    }


SECTIONS: dict[str, Callable[[bool], dict[str, Any]]] = {"stop": measure_stop}


def main(argv: list[str] | None = None) -> None:
    ap = cli_parser(__doc__, "~1 minute")
    ap.add_argument("--only", action="append", choices=sorted(SECTIONS), default=None,
                    help="run this section only (repeatable; default: all)")
    args = ap.parse_args(argv)
    names = args.only or list(SECTIONS)
    # a partial run does not write the shared block (it would drop the other sections)
    docs = docs_of(args) if args.docs or set(names) == set(SECTIONS) else None
    started = time.monotonic()
    results = Results()
    for name in names:
        results.section = name
        for row in SECTIONS[name](args.quick)["rows"]:
            results.add(*row)
    results.print("benchmarks.control")
    if docs is not None:
        load = os.getloadavg()[0]
        write_block("control", results.markdown(), "python -m benchmarks.control",
                    machine_info(None, f"load average {load:.1f} at the end"),
                    time.monotonic() - started, path=docs)


if __name__ == "__main__":
    main()
