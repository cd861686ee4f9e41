"""The in-process engine tests' helpers (tests/integration/test_engines*.py): an
engine of ``tests.engine_models:Sized``, a host run in a thread, an engine command
asked and its answer waited for. Their counters are reset by the ``engine_counters``
fixture (tests/integration/conftest.py)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import mtq
from mtq.workers.host import Host
from mtq.workers.residency import EngineOp
from mtq.workers.worker import Worker
from tests.support.workers import FAST

SIZED = "tests.engine_models:Sized"
FLOATS = 4096  # 16 KiB of weights per model


def engine(queue: str, url: str, tag: str, **kw: Any) -> Worker:
    options = {"tag": tag, "floats": str(FLOATS), **kw.pop("options", {})}
    return Worker(SIZED, queue, url=url, settings=FAST, options=options, **kw)


@contextmanager
def hosting(host: Host) -> Iterator[threading.Thread]:
    host.setup()
    t = threading.Thread(target=host.run, daemon=True)
    t.start()
    try:
        yield t
    finally:
        host.stop()
        t.join(30)
        assert not t.is_alive(), "the host did not stop"


def ask(w: Worker, kind: str, **kw: Any) -> dict[str, Any]:
    """Ask ``w`` for an engine command and wait for its answer."""
    got: list[dict[str, Any]] = []
    done = threading.Event()

    def reply(answer: dict[str, Any]) -> None:
        got.append(answer)
        done.set()

    w.request(EngineOp(kind, reply=reply, **kw))
    assert done.wait(30), f"no answer to {kind}"
    return got[0]


def result(q: mtq.Queue, payload: Any) -> Any:
    return q.submit(payload).result(timeout=20)


