"""The templates' filters: figures as short text (``who`` and ``model`` also name the
terminal dashboard's workers). Every one returns plain text (the template engine
escapes it like any other value)."""

from __future__ import annotations

import time
from typing import Any

DASH = "\u2013"  # no value (yet)


def rate(v: float | None) -> str:
    if v is None:
        return DASH
    return f"{v:.1f}" if v < 1000 else f"{v:,.0f}"


def ms(v: float | None) -> str:
    if v is None:
        return DASH
    if v >= 10_000:
        return f"{v / 1000:.1f} s"
    return f"{v:.1f} ms" if v < 10 else f"{v:.0f} ms"


def count(n: Any) -> str:
    if not isinstance(n, (int, float)) or isinstance(n, bool):
        return DASH
    n = round(n)
    return f"{n:,}" if n < 10_000_000 else f"{n / 1e6:.1f}M"


def clock(ts: float | None) -> str:
    """A unix time (s) as this host's local time of day."""
    if not ts:
        return DASH
    return time.strftime("%H:%M:%S", time.localtime(ts))


def clock_ms(ts_ms: Any) -> str:
    """A time in ms since the epoch (as Redis records them) with its date."""
    if not isinstance(ts_ms, (int, float)) or not ts_ms:
        return DASH
    s = ts_ms / 1000
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(s)) + f".{int(ts_ms) % 1000:03d}"


def ago(ts: Any, now: float | None = None) -> str:
    """How long ago a unix time (s) was."""
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or ts <= 0:
        return DASH
    d = max(0.0, (time.time() if now is None else now) - ts)
    if d < 120:
        return f"{d:.0f} s"
    if d < 7200:
        return f"{d / 60:.0f} min"
    return f"{d / 3600:.1f} h"


def size(n: Any) -> str:
    """Bytes with a binary unit."""
    if isinstance(n, bool) or not isinstance(n, (int, float)) or n < 0:
        return DASH
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= k:
            return f"{n / k:.1f} {unit}"
    return f"{n:.0f} B"


def device_memory(w: dict[str, Any]) -> str:
    """A worker's device memory in use / total (its ``memory`` report), else the
    memory its model holds (``memory_bytes``), else a dash."""
    mem = w.get("memory")
    if isinstance(mem, dict) and mem.get("total"):
        used = mem.get("allocated") or mem.get("reserved") or 0
        return f"{size(used)} / {size(mem['total'])}"
    if w.get("memory_bytes") and w.get("engine") in (None, "loaded", "unloading"):
        return size(w.get("memory_bytes"))
    return DASH


def who(w: dict[str, Any]) -> str:
    host = w.get("host") or w.get("id") or "?"
    return f"{host}:{w['pid']}" if w.get("pid") is not None else str(host)


def model(w: dict[str, Any]) -> str:
    name, version = w.get("model"), w.get("version")
    if not name:
        return DASH
    return f"{name}/{version}" if version not in (None, "") else str(name)


def error_line(error: Any, limit: int = 200) -> str:
    """An error's last line (a traceback's says what), cut to ``limit`` characters."""
    text = str(error or "").strip()
    line = text.splitlines()[-1] if text else ""
    return line if len(line) <= limit else line[:limit] + "…"


FILTERS = {"rate": rate, "ms": ms, "count": count, "clock": clock, "clock_ms": clock_ms,
           "ago": ago, "size": size, "device_memory": device_memory, "who": who,
           "model": model, "error_line": error_line}
