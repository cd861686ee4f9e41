"""Small worker targets for subprocess tests (``tests.handlers:<name>``).

Kept free of numpy/torch imports so a worker using them starts fast.
"""

from __future__ import annotations

import os
from typing import Any


def double(payload: dict[str, Any]) -> Any:
    """``{"x": n}`` -> ``2 * n``."""
    return payload["x"] * 2


def boom(payload: Any) -> Any:
    """Always fails with a ValueError naming the payload."""
    raise ValueError(f"boom on {payload!r}")


def record(payload: Any) -> dict[str, Any]:
    """Echo the payload with the worker's pid, to see who ran what."""
    return {"pid": os.getpid(), "payload": payload}


def identity(payload: Any) -> Any:
    """Return the payload unchanged."""
    return payload


def logged(payload: dict[str, Any]) -> dict[str, Any]:
    """Log the call as it starts (``B``) and ends (``D``) in ``MTQ_TEST_LOG`` (the format
    of tests/models.py), sleeping ``payload["sleep"]`` seconds in between; echo s and i."""
    import time

    from tests.models import _log

    _log("B", [payload])
    time.sleep(float(payload.get("sleep", 0)))
    _log("D", [payload])
    return {"pid": os.getpid(), "s": payload.get("s"), "i": payload.get("i")}


def deep(payload: dict[str, Any], depth: int = 0) -> Any:
    """Recurse ``payload["depth"]`` calls deep (through two functions, so Python
    cannot fold the frames into "previous line repeated"), then raise: a long
    traceback."""
    if depth < payload["depth"]:
        return _deeper(payload, depth + 1)
    raise ValueError("bad input to model, deep down")


def _deeper(payload: dict[str, Any], depth: int) -> Any:
    return deep(payload, depth + 1)


def chunks(payload: dict[str, Any]) -> Any:
    """Stream ``payload["chunks"]`` as tokens, then fail with ``payload["fail"]`` as the
    error if it is given, else return the number of chunks. With ``"progress": value``
    and ``"gate": path``, first report progress ``value`` again and again until the
    file ``path`` exists (at most 10 s): a progress event is not stored, so a test
    opens the gate once its client has printed one."""
    import time

    import mtq

    if payload.get("gate"):
        deadline = time.monotonic() + 10
        while not os.path.exists(payload["gate"]) and time.monotonic() < deadline:
            yield mtq.Progress(payload.get("progress"))
            time.sleep(0.05)  # polling the gate, which a process of its own creates
    yield from payload.get("chunks", [])
    if payload.get("fail"):
        raise mtq.PermanentError(payload["fail"])
    return len(payload.get("chunks", []))


def fail_if(payload: dict[str, Any]) -> Any:
    """Fails with a ValueError when ``payload["fail"]`` is true, else returns it."""
    if payload.get("fail"):
        raise ValueError(f"asked to fail: {payload!r}")
    return payload


def gated(payload: dict[str, Any]) -> dict[str, Any]:
    """Log the call (``B``/``D`` in ``MTQ_TEST_LOG``) and, in between, wait (at most 30 s)
    while the file ``payload["gate"]`` exists; fail with a ValueError while the file
    ``payload["fail"]`` exists. Echoes ``payload["i"]`` (result cache tests)."""
    import time

    from tests.models import _log

    _log("B", [payload])
    deadline = time.monotonic() + 30
    while payload.get("gate") and os.path.exists(payload["gate"]) and \
            time.monotonic() < deadline:
        time.sleep(0.01)
    if payload.get("fail") and os.path.exists(payload["fail"]):
        raise ValueError("asked to fail")
    _log("D", [payload])
    return {"i": payload.get("i"), "pid": os.getpid()}


def gated_costed(payload: dict[str, Any]) -> Any:
    """:func:`gated`, its result reporting the cost ``payload["cost"]`` (mtq.Costed)."""
    import mtq

    return mtq.Costed(gated(payload), cost=payload["cost"])
