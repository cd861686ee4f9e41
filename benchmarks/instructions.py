"""Redis's own work per task, in CPU instructions: redis-server run under valgrind's
callgrind, counted only while the measured loop runs. Unlike timings, these counts
repeat to about 0.1 % on a busy or a slow machine, so two trees can be compared
reliably.

* **submitted task**: 5,000 no-op tasks submitted with ``submit_many``, 1,000 a call
  (then drained, not counted): instructions per task.
* **drained task**: 3,200 no-op tasks submitted (not counted), then claimed and acked by a
  ``Consumer`` in batches of 64 (``settle_and_claim``, as a worker does): instructions
  per task.
* **round trip**: 200 times, one task submitted, claimed alone and acked: instructions per
  round trip (three script calls, each paying its fixed cost).
* **round trip to a sleeping worker**: 200 times, as a worker's fetcher sees it: one task
  submitted while the consumer sleeps in ``wait`` (a tree with direct delivery hands it
  over there; an older one wakes it with a marker, and it claims), then acked.

``--against REV`` measures the tree of a git revision the same way, in the same run
(``git archive`` into a temporary directory), and prints both with the change.

    python -m benchmarks.instructions                   # this tree, prints
    python -m benchmarks.instructions --against HEAD~3  # and another revision
    python -m benchmarks.instructions --against REV --docs   # rewrites "## Redis instructions"

Needs ``valgrind`` (Debian: ``apt-get install valgrind``); the redis-server is the one
mtq's embedded Redis finds, or ``$MTQ_BENCH_REDIS_SERVER``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

from benchmarks.broker import ROOT, write_docs

#: run with ``python -c`` and PYTHONPATH set to the tree measured, so that it uses only
#: what every mtq since the hot-path work has: Queue, Consumer, Outcome.
CHILD = r'''
import os, socket, subprocess, sys, time
import redis, mtq
from mtq.broker.consumer import Consumer, Outcome
from mtq.broker.embedded import find_redis_server

what, dump, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
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
        break
    except redis.ConnectionError:
        if proc.poll() is not None or time.monotonic() > deadline:
            sys.exit("redis-server under valgrind did not start")
        time.sleep(0.1)
q, c = mtq.Queue("cg", client=r), Consumer("cg", client=r)
q.submit_many([None] * 64)  # scripts loaded, keys made
c.settle([Outcome(t, True, None) for t in c.claim(64)])

def instrument(on):
    subprocess.run(["callgrind_control", "-i", "on" if on else "off", str(proc.pid)],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

if what == "submit":
    instrument(True)
    for _ in range(n // 1000):
        q.submit_many([None] * 1000)
    instrument(False)
    held = c.claim(64)  # (not counted) so that every task succeeded, as checked below
    while held:
        _, held = c.settle_and_claim([Outcome(t, True, None) for t in held], 64)
elif what == "drain":
    q.submit_many([None] * n)
    instrument(True)
    held = c.claim(64)
    while held:
        _, held = c.settle_and_claim([Outcome(t, True, None) for t in held], 64)
elif what == "roundtrip":
    instrument(True)
    for _ in range(n):
        q.submit(None)
        c.settle([Outcome(t, True, None) for t in c.claim(1)])
else:  # a sleeping worker: its claim found nothing, it waits
    c.direct = True  # (an attribute older trees do not read)
    assert c.claim(64) == []
    instrument(True)
    for _ in range(n):
        q.submit(None)
        woke = c.wait(5)
        held = woke if isinstance(woke, list) else c.claim(64)
        c.settle([Outcome(t, True, None) for t in held])
        if not isinstance(woke, list) or not getattr(c, "registered", True):
            assert c.claim(64) == []  # asleep again, as its fetcher would be
instrument(False)
done = int(r.hget(q.broker.keys.stats, "succeeded"))
assert done == n + 64, f"{done} succeeded, expected {n + 64}"
try:
    r.shutdown(nosave=True)
except redis.ConnectionError:
    pass
proc.wait(120)
'''

CASES = (("submitted task (submit_many of 1,000)", "submit", 5000),
         ("drained task (batch 64)", "drain", 3200), ("round trip (one task)", "roundtrip", 200),
         ("round trip to a sleeping worker (one task)", "sleeping", 200))


def _total(dump: Path) -> int:
    # "summary:" at the top is written before the run (0 with --instr-atstart=no);
    # "totals:" at the end is the count
    totals = re.findall(r"^totals:\s*(\d+)", dump.read_text(encoding="utf-8", errors="replace"),
                        flags=re.M)
    if not totals or not int(totals[-1]):
        raise SystemExit(f"no instruction count in {dump}")
    return int(totals[-1])


def measure(tree: Path) -> dict[str, float]:
    """Instructions per unit for each case, with mtq imported from ``tree``."""
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="mtq-cg-") as tmp:
        for label, what, n in CASES:
            dump = Path(tmp) / f"{what}.out"
            env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
            subprocess.run([sys.executable, "-c", CHILD, what, str(dump), str(n)], env=env,
                           check=True, cwd=tmp, timeout=900)
            out[label] = _total(dump) / n
    return out


def export(rev: str, into: Path) -> str:
    """The tree of ``rev`` under ``into``; returns its short commit id."""
    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.strip()
    archive = subprocess.run(["git", "archive", sha], cwd=ROOT, check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return sha


def table(now: dict[str, float], ref: dict[str, float] | None, ref_name: str) -> str:
    if ref is None:
        rows = ["| redis-server instructions per | this tree |", "|---|---:|"]
        rows += [f"| {label} | {now[label]:,.0f} |" for label, _, _ in CASES]
    else:
        rows = [f"| redis-server instructions per | {ref_name} | this tree | change |",
                "|---|---:|---:|---:|"]
        rows += [f"| {label} | {ref[label]:,.0f} | {now[label]:,.0f} | "
                 f"{100 * (now[label] / ref[label] - 1):+.1f} % |" for label, _, _ in CASES]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", metavar="REV", help="a git revision to measure alongside")
    ap.add_argument("--docs", action="store_true",
                    help='rewrite "## Redis instructions" in docs/benchmarks.md')
    args = ap.parse_args(argv)
    if not shutil.which("valgrind") or not shutil.which("callgrind_control"):
        raise SystemExit("valgrind is not installed (Debian: apt-get install valgrind)")
    ref, ref_name = None, ""
    if args.against:
        with tempfile.TemporaryDirectory(prefix="mtq-rev-") as tmp:
            ref_name = f"`{export(args.against, Path(tmp))}`"
            ref = measure(Path(tmp))
    now = measure(ROOT)
    text = table(now, ref, ref_name)
    print(text)
    if args.docs:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True).stdout.strip()
        cmd = "python -m benchmarks.instructions" + (f" --against {args.against}"
                                                     if args.against else "") + " --docs"
        write_docs(ROOT / "docs" / "benchmarks.md", "\n".join([
            "## Redis instructions", "",
            f"{date.today().isoformat()}, `{cmd}` (this tree: `{head}` and its working "
            "changes). redis-server under valgrind's callgrind, counted only while the loop "
            "runs; the counts repeat to about 0.1 %, so they compare trees where timings on "
            "this machine cannot.", "", text, ""]), heading="## Redis instructions")


if __name__ == "__main__":
    main()
