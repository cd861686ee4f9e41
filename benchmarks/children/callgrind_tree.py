"""benchmarks.instructions' child: one case measured on a redis-server under valgrind's
callgrind, counted only while the loop runs, with mtq from the tree first on
``PYTHONPATH``. It uses only what every mtq since the hot-path work has: Queue,
Consumer, Outcome. Run by file path with ``python -P``.

    python -P callgrind_tree.py CASE DUMP N     # CASE: submit, drain, roundtrip, sleeping,
                                                #   drain_sched (this tree's scheduling)

``drain_sched`` is ``drain`` of tasks that carry a tenant (one of four) and a priority
(each band in turn), which turns the queue's scheduling on (benchmarks/scheduling.py);
``drain_streams`` and ``drain_sched_streams`` the same two of tasks in 400 streams (each
stream a tenant's, in one band), ``sleeping_sched`` ``sleeping`` of such tasks; only trees
with scheduling have the scheduled ones.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from typing import Any

import redis

import mtq
from mtq.broker.consumer import Consumer, Outcome
from mtq.broker.embedded import find_redis_server


def start(dump: str) -> tuple[subprocess.Popen[bytes], redis.Redis]:
    binary = os.environ.get("MTQ_BENCH_REDIS_SERVER") or find_redis_server()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(["valgrind", "--tool=callgrind", "--instr-atstart=no",
                             f"--callgrind-out-file={dump}", binary, "--port", str(port),
                             "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", os.path.dirname(dump)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    r = redis.Redis(port=port)
    deadline = time.monotonic() + 120
    while True:
        try:
            r.ping()
            return proc, r
        except redis.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                sys.exit("redis-server under valgrind did not start")
            time.sleep(0.1)


def drain(c: Consumer, held: list[Any]) -> None:
    while held:
        _, held = c.settle_and_claim([Outcome(t, True, None) for t in held], 64)


def main(what: str, dump: str, n: int) -> None:
    proc, r = start(dump)
    q, c = mtq.Queue("cg", client=r), Consumer("cg", client=r)
    q.submit_many([None] * 64)  # scripts loaded, keys made
    c.settle([Outcome(t, True, None) for t in c.claim(64)])

    def instrument(on: bool) -> None:
        subprocess.run(["callgrind_control", "-i", "on" if on else "off", str(proc.pid)],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    if what == "submit":
        instrument(True)
        for _ in range(n // 1000):
            q.submit_many([None] * 1000)
        instrument(False)
        drain(c, c.claim(64))  # (not counted) so that every task succeeded, as checked below
    elif what == "drain":
        q.submit_many([None] * n)
        instrument(True)
        drain(c, c.claim(64))
    elif what == "drain_sched":
        lanes = [(f"t{i}", p) for i in range(4) for p in ("interactive", "standard", "batch")]
        q.submit_many([mtq.Request(None, tenant=t, priority=p)
                       for t, p in (lanes[i % len(lanes)] for i in range(n))])
        instrument(True)
        drain(c, c.claim(64))
    elif what == "drain_streams":  # tasks of 400 streams (users)
        q.submit_many([mtq.Request(None, stream=f"u{i % 400}") for i in range(n)])
        instrument(True)
        drain(c, c.claim(64))
    elif what == "drain_sched_streams":  # the same, each user a tenant's, in a band
        lanes = [(f"t{i}", p) for i in range(4) for p in ("interactive", "standard", "batch")]
        q.submit_many([mtq.Request(None, stream=f"u{i % 400}", tenant=lanes[i % 400 % 12][0],
                                   priority=lanes[i % 400 % 12][1]) for i in range(n)])
        instrument(True)
        drain(c, c.claim(64))
    elif what == "roundtrip":
        instrument(True)
        for _ in range(n):
            q.submit(None)
            c.settle([Outcome(t, True, None) for t in c.claim(1)])
    else:  # a sleeping worker: its claim found nothing, it waits
        c.direct = True  # (an attribute older trees do not read)
        if what == "sleeping_sched":  # the queue schedules: each task a tenant's, in a band
            q.submit(None, tenant="t0", priority="batch")
            drain(c, c.claim(64))
        assert c.claim(64) == []
        instrument(True)
        for i in range(n):
            if what == "sleeping_sched":
                q.submit(None, tenant=f"t{i % 4}", priority=("interactive", "standard")[i % 2])
            else:
                q.submit(None)
            woke = c.wait(5)
            held = woke if isinstance(woke, list) else c.claim(64)
            c.settle([Outcome(t, True, None) for t in held])
            if not isinstance(woke, list) or not getattr(c, "registered", True):
                assert c.claim(64) == []  # asleep again, as its fetcher would be
    instrument(False)
    done = int(r.hget(q.broker.keys.stats, "succeeded") or 0)
    warm = 65 if what == "sleeping_sched" else 64
    assert done == n + warm, f"{done} succeeded, expected {n + warm}"
    try:
        r.shutdown(nosave=True)
    except redis.ConnectionError:
        pass
    proc.wait(120)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
