"""The outlet: a worker's publisher in a process of its own.

A generator streams every decode step: with the publisher as a thread of the
worker process, each Redis trip (encode the call, send, parse the reply) takes the
GIL from the model thread and hands it back, which slows its decode rate on a
small host (docs/streaming.md says how much). So, as vLLM does its output
processing outside its engine process, a worker serving a
:class:`~mtq.workers.generator.Generator` hands its tokens and outcomes through a
pipe to ``python -m mtq.workers.outlet``, which streams, acknowledges and retries
them exactly as the publisher thread would (the same :meth:`Consumer.settle
<mtq.broker.consumer.Consumer.settle>`, fenced by the same lease tokens).

The model thread's cost per step is one ``msgpack.packb`` and one ``os.write``,
and no wake-up of another process:

* plain tokens (str, bytes, int, float, bool) cross the pipe as they are and
  the outlet encodes them; anything else (a tensor, a list) is encoded in the
  worker, so a value that cannot be encoded fails its own task there;
* while tokens flow, the outlet reads the pipe on its own timer, every
  ``Generator.stream_interval_ms`` (see :class:`_PacedReader`), so a write
  finds nobody waiting on the pipe. A write that wakes a waiting reader runs
  that reader, as often as not, on the model thread's core, preempting it. It
  waits on the pipe again only once it finds the pipe empty, so the first token
  after a pause leaves at once.

The outlet answers with what each trip settled (counters, lost leases, streams to
stop), read by a thread of the worker that never blocks the model. Ordering and
guarantees do not change: a task is forgotten by the worker (its lease no longer
extended) only once the outlet reports it settled or given up.

Faults:

* the worker dies: the outlet reads end-of-file, settles what it already has and
  exits; the rest is redelivered when its leases expire, as for any dead worker;
* the outlet dies: the worker logs it, forgets the outcomes it had sent and not
  seen settled and stops the generations it runs (their streams may have holes),
  so their leases expire and they run again with a ``restarted`` event; it then
  settles through its publisher thread for the rest of its life;
* SIGINT / SIGTERM aimed at the process group are ignored here: the outlet ends
  when its worker closes the pipe, after the worker's graceful stop.

Wire format, msgpack over two pipes: worker -> outlet ``["hello", {...}]`` then
``["settle", chunks, outcomes]`` ... ``["end"]``, a chunk being ``[task id, lease
token, index, value, plain]`` (``plain``: the value itself, else its encoded
bytes); outlet -> worker ``["report", {...}]`` ... ``["bye"]``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack

from mtq.broker.config import from_wire, to_wire
from mtq.broker.consumer import (
    OUTCOME_COUNTERS,
    Chunk,
    Consumer,
    Encoded,
    Outcome,
    SettleReport,
    encode,
)
from mtq.broker.protocol import Claimed

if TYPE_CHECKING:
    from mtq.workers.ledger import Ledger
    from mtq.workers.protocols import SettleReports

log = logging.getLogger(__name__)

#: the outlet reports tokens streamed at least this often when no task finishes
REPORT_EVERY_S = 1.0
#: how long a stopping outlet keeps retrying while Redis is unreachable
GIVE_UP_AFTER_S = 10.0
#: the ints msgpack carries (a token outside goes through encode(), which says so)
_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _messages(fd: int) -> Any:
    """Yield the msgpack messages read from ``fd`` until end-of-file."""
    unpacker = msgpack.Unpacker(raw=False)
    while True:
        data = os.read(fd, 1 << 16)
        if not data:
            return
        unpacker.feed(data)
        yield from unpacker


class _PacedReader:
    """The outlet's side of the pipe: msgpack messages until end-of-file.

    While tokens flow it reads at most every :attr:`pace_s`, woken by its own
    timer, and blocks on the pipe only once it found it empty. A pipe write wakes
    a reader waiting on it synchronously, and the kernel then tends to run that
    reader on the writer's core, where it preempts the model thread: waiting on a
    timer instead, the outlet costs the model thread one ``os.write`` per step and
    no wake-up (the trips were paced anyway: ``Generator.stream_interval_ms``).
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.pace_s = 0.0
        self._unpacker = msgpack.Unpacker(raw=False)
        os.set_blocking(fd, False)

    def _read(self, wait: bool) -> bytes | None:
        """What the pipe holds (b"" at end-of-file); None if empty and not ``wait``."""
        while True:
            try:
                return os.read(self.fd, 1 << 20)
            except BlockingIOError:
                if not wait:
                    return None
                select.select([self.fd], [], [])

    def __iter__(self) -> Any:
        wait = True
        while True:
            data = self._read(wait)
            if data is None:  # found empty after a pause: block until the next write
                wait = True
                continue
            if not data:
                return
            self._unpacker.feed(data)
            yield from self._unpacker
            wait = self.pace_s <= 0
            if not wait:  # pacing, not a wait for an event: see the docstring
                time.sleep(self.pace_s)


# -- worker side -----------------------------------------------------------------
class Outlet:
    """The worker's handle on its outlet process (see the module docstring): an
    :class:`~mtq.workers.protocols.OutcomeSink` that reports what it settled to
    ``reports`` and marks in ``ledger`` the tasks whose streams cannot go on."""

    def __init__(self, consumer: Consumer, ledger: Ledger, reports: SettleReports, url: str,
                 interval_ms: float = 0.0) -> None:
        self.consumer = consumer
        self.ledger = ledger
        self.reports = reports
        self.url = url
        self.interval_ms = interval_ms
        self.proc: subprocess.Popen[bytes] | None = None
        self.dead = False
        self._lock = threading.Lock()
        self._pending: set[tuple[str, str]] = set()  # (id, token) sent, not yet settled
        self._out = -1
        self._in = -1
        self._bye = threading.Event()
        self._reader: threading.Thread | None = None

    def start(self) -> None:
        to_r, to_w = os.pipe()
        from_r, from_w = os.pipe()
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parent.parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "mtq.workers.outlet", str(to_r), str(from_w)],
                pass_fds=(to_r, from_w), stdin=subprocess.DEVNULL, env=env)
        finally:
            os.close(to_r)
            os.close(from_w)
        self._out, self._in = to_w, from_r
        c = self.consumer
        _write_all(self._out, msgpack.packb(["hello", {
            "url": self.url, "queue": c.queue, "worker_id": c.worker_id,
            "settings": to_wire(c.broker.source), "interval_ms": self.interval_ms}]))
        self._reader = threading.Thread(target=self._read_loop, name="mtq-outlet-reader",
                                        daemon=True)
        self._reader.start()

    def put(self, items: Sequence[Outcome | Chunk]) -> bool:
        """Encode ``items`` here and send them; False if the outlet is gone (the
        caller settles them another way)."""
        if self.dead:
            return False
        chunks: list[list[Any]] = []
        outcomes: list[list[Any]] = []
        bad: set[str] = set()
        for x in items:
            t = x.task
            if type(x) is Chunk:
                if t.id in bad:
                    continue
                v = x.value
                kind = type(v)
                if kind is str or kind is bytes or kind is float or v is None or kind is bool \
                        or (kind is int and _INT_MIN <= v <= _INT_MAX):
                    # plain: it crosses the pipe as it is, the outlet encodes it
                    chunks.append([t.id, t.token, x.index, v, True])
                    continue
                try:
                    chunks.append([t.id, t.token, x.index, encode(v), False])
                except Exception as exc:  # an unencodable token fails its task alone
                    bad.add(t.id)
                    outcomes.append(self._row(t, False, None, f"{type(exc).__name__}: token "
                                              f"{x.index}: {exc}", False, False))
                continue
            if t.id in bad:
                continue
            assert isinstance(x, Outcome)  # not a Chunk (above): one check per task
            if x.ok:
                try:
                    outcomes.append(self._row(t, True, encode(x.value), None, True, False,
                                              x.cost))
                    continue
                except Exception as exc:  # PayloadError, or anything a tensor's .cpu() raises
                    x = Outcome(t, ok=False, error=f"{type(exc).__name__}: {exc}",
                                retryable=False)
            error = x.error if not x.traceback else f"{x.error}\0{x.traceback}"
            outcomes.append(self._row(t, False, None, error, x.retryable, x.cancelled, x.cost,
                                      x.released))
        if bad:  # a generator stops generating them
            self.ledger.mark_lost(bad)
        data = msgpack.packb(["settle", chunks, outcomes])
        with self._lock:
            if self.dead:
                return False
            self._pending.update((o[0], o[1]) for o in outcomes)
            try:
                _write_all(self._out, data)
            except OSError:  # it died; the reader thread reports it
                self._pending.difference_update((o[0], o[1]) for o in outcomes)
                self.dead = True
                return False
        return True

    @staticmethod
    def _row(t: Claimed, ok: bool, data: bytes | None, error: str | None, retryable: bool,
             cancelled: bool, cost: float | None = None, released: bool = False) -> list[Any]:
        return [t.id, t.token, t.attempts, t.deliveries, t.retries, ok, data, error,
                retryable, cancelled, cost, released]

    def _read_loop(self) -> None:
        reports = self.reports
        try:
            for msg in _messages(self._in):
                if msg[0] == "bye":
                    self._bye.set()
                    continue
                body = msg[1]
                report = SettleReport(**{k: body[k] for k in OUTCOME_COUNTERS},
                                      lost=body["lost"], stream_lost=body["stream_lost"],
                                      streamed=body["streamed"])
                reports.record(report)
                settled = [(i, token) for i, token in body["settled"]]
                with self._lock:
                    self._pending.difference_update(settled)
                reports.settled(settled)
        except Exception:
            log.exception("reading the outlet's reports failed")
        finally:
            os.close(self._in)
        if not self._bye.is_set():
            self._died()

    def _died(self) -> None:
        with self._lock:
            self.dead = True
            pending = sorted(self._pending)
            self._pending.clear()
        try:
            code = self.proc.wait(5) if self.proc is not None else None
        except subprocess.TimeoutExpired:  # it closed its pipe but lives on: end it
            self.proc.kill()  # type: ignore[union-attr]
            code = self.proc.wait(5)  # type: ignore[union-attr]
        self.ledger.lose_all()
        log.error("the outlet process died (exit code %s): %d unsettled outcome(s) and the "
                  "running generations run again once their leases expire; settling in "
                  "the worker process from now on", code, len(pending))
        self.ledger.forget(pending)

    def close(self, timeout: float = 30.0) -> None:
        """Send everything left, wait for the outlet to settle it and exit."""
        with self._lock:
            if not self.dead:
                try:
                    _write_all(self._out, msgpack.packb(["end"]))
                except OSError:
                    self.dead = True
            os.close(self._out)
        if self._reader is not None:
            self._reader.join(timeout)
        if self.proc is not None:
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                log.error("the outlet process did not exit; killing it")
                self.proc.kill()
                self.proc.wait(5)


# -- outlet side ---------------------------------------------------------------------
def _claimed(row: Sequence[Any]) -> Claimed:
    """The task of an outcome row: what settling it reads (id, lease token, attempts)."""
    return Claimed(row[0], row[1], b"", None, row[2], row[3], row[4])


def _outcome(o: list[Any]) -> Outcome:
    """An outcome row from the worker (see ``_row``); an error row may carry the
    traceback after a NUL."""
    if o[5]:
        return Outcome(_claimed(o), ok=True, value=Encoded(o[6]), cost=o[10])
    error, _, tb = (o[7] or "").partition("\0")
    return Outcome(_claimed(o), ok=False, error=error, retryable=o[8], cancelled=o[9],
                   traceback=tb or None, cost=o[10], released=o[11])


def _settle_loop(consumer: Consumer, inbox: queue.SimpleQueue[Any], out_fd: int) -> None:
    done = ended = False
    last_report = time.monotonic()
    tally = SettleReport()
    settled: list[tuple[str, str]] = []
    while not done:
        msg = inbox.get()
        chunks: list[Chunk] = []
        outcomes: list[Outcome] = []
        while msg is not None:
            if msg[0] == "settle":
                chunks += [Chunk(Claimed(c[0], c[1], b"", None, 0, 0, None), c[2],
                                 c[3] if c[4] else Encoded(c[3])) for c in msg[1]]
                outcomes += [_outcome(o) for o in msg[2]]
            elif msg[0] == "end":
                ended = done = True
            elif msg[0] == "eof":
                done = True
            try:
                msg = inbox.get_nowait()
            except queue.Empty:
                msg = None
        if chunks or outcomes:
            report = _settle(consumer, outcomes, chunks, GIVE_UP_AFTER_S if done else None)
            settled += [(o.task.id, o.task.token) for o in outcomes]
            if report is not None:
                for name in OUTCOME_COUNTERS:
                    setattr(tally, name, getattr(tally, name) + getattr(report, name))
                tally.lost += report.lost
                tally.stream_lost += report.stream_lost
                tally.streamed += report.streamed
        now = time.monotonic()
        if settled or tally.lost or tally.stream_lost or done or \
                (tally.streamed and now - last_report >= REPORT_EVERY_S):
            body = dataclasses.asdict(tally)
            body["settled"] = settled
            try:
                _write_all(out_fd, msgpack.packb(["report", body]))
            except OSError:
                pass  # the worker is gone; what was settled stays settled
            tally, settled, last_report = SettleReport(), [], now
    if ended:
        try:
            _write_all(out_fd, msgpack.packb(["bye"]))
        except OSError:
            pass


def _settle(consumer: Consumer, outcomes: list[Outcome], chunks: list[Chunk],
            give_up_after: float | None) -> SettleReport | None:
    """Settle in one round trip (retried while Redis is unreachable); None when it
    gave up or failed (the tasks run again when their leases expire)."""
    try:
        return consumer.settle_retrying(outcomes, chunks, give_up_after)
    except Exception:  # never die on one bad batch: nothing would settle again
        log.exception("settling %d task(s) failed; they run again when their leases "
                      "expire", len(outcomes))
        return None


def main(argv: Sequence[str]) -> int:
    """``python -m mtq.workers.outlet IN_FD OUT_FD`` (started by :class:`Outlet`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=os.environ.get("MTQ_LOG_LEVEL", "WARNING").upper(),
                        format="%(asctime)s %(levelname)s mtq.outlet[%(process)d] %(message)s")
    in_fd, out_fd = int(argv[0]), int(argv[1])
    inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
    reader = _PacedReader(in_fd)
    messages = iter(reader)
    hello = next(messages, None)
    if hello is None or hello[0] != "hello":
        return 2
    h = hello[1]
    reader.pace_s = float(h["interval_ms"]) / 1000
    consumer = Consumer(h["queue"], h["url"], settings=from_wire(h["settings"]),
                        worker_id=h["worker_id"])

    def read() -> None:  # keeps the pipe drained, so the model thread never blocks on it
        try:
            for msg in messages:
                inbox.put(msg)
        finally:
            inbox.put(["eof"])

    threading.Thread(target=read, name="mtq-outlet-read", daemon=True).start()
    _settle_loop(consumer, inbox, out_fd)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
