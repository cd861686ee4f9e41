"""The host file: the engines a host process runs, and its processes, in one TOML file.

``mtq workers start --config host.toml`` reads it with :func:`load`::

    [host]                    # optional; every key optional
    devices = "cuda:0"        # cpu | cuda:0,cuda:1 | all, or a list ["cuda:0", "cuda:1"]
    replicas = 1              # processes per device; each hosts every engine
    memory_budget = "12GiB"   # bytes of model tensors per process
    max_loaded = 2            # most engines loaded at once per process
    standby = 0               # a warm spare process per device (0 or 1)
    lease_ms = 30000          # lease of a claimed task, every queue

    [[engine]]                # one per queue
    queue = "embed"
    target = "hf:Embedder"
    options = { model = "/srv/minilm" }
    max_batch_size = 64
    max_wait_ms = 5
    timeout = 30
    on_demand = false
    idle_unload_s = 600
    memory = "500MiB"

    [[schedule]]              # optional; a periodic task (docs/workers.md, Schedules)
    name = "nightly-reindex"
    queue = "embed"
    cron = "30 2 * * *"       # five fields, or six with seconds last
    payload = { text = "x" }  # any TOML value, submitted as its JSON
    tz = "Europe/Paris"       # optional: UTC
    catch_up = "latest"       # optional: all | latest | none
    stream = "reindex"        # optional
    tenant = "ops"            # optional

Everything is checked before anything starts, and the first mistake is a
:class:`~mtq.errors.HostFileError` whose message starts with ``FILE:LINE:`` (the
line of the key, or of the table, at fault): a TOML syntax error, an unknown key,
a value of the wrong type or out of range, a missing ``queue`` or ``target``, a
bad queue name, the same queue twice, a target whose module cannot be found or
options it does not take, a device this machine does not have, a budget that the
engines loaded at start already pass. See docs/workers.md, "The host file".
"""

from __future__ import annotations

import difflib
import math
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

from mtq.errors import HostFileError, MtqError, OptionError
from mtq.workers.tomllines import Path, key_lines, line_of

#: the keys of each table, in the order the docs list them
HOST_KEYS = ("devices", "replicas", "memory_budget", "max_loaded", "standby", "lease_ms")
ENGINE_KEYS = ("queue", "target", "options", "max_batch_size", "max_wait_ms", "timeout",
               "on_demand", "idle_unload_s", "memory")
SCHEDULE_KEYS = ("name", "queue", "cron", "payload", "stream", "tenant", "tz", "catch_up")
TOP_KEYS = ("host", "engine", "schedule")

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")


@dataclass(frozen=True)
class EngineSpec:
    """One ``[[engine]]``: a queue and the model that serves it."""

    queue: str
    target: str
    #: the model's options as text, as ``--set KEY=VALUE`` gives them
    options: dict[str, str] = field(default_factory=dict)
    max_batch_size: int | None = None
    max_wait_ms: float | None = None
    timeout_s: float | None = None
    on_demand: bool = False
    idle_unload_s: float | None = None
    memory_bytes: int | None = None
    #: the line of its ``[[engine]]`` header
    line: int = 0

    def overrides(self) -> dict[str, Any]:
        """max_batch_size / max_wait_ms / timeout_s, those given."""
        return {k: v for k, v in (("max_batch_size", self.max_batch_size),
                                  ("max_wait_ms", self.max_wait_ms),
                                  ("timeout_s", self.timeout_s)) if v is not None}

    def to_dict(self) -> dict[str, Any]:
        """The plain form a supervisor hands its processes (mtq.workers.child)."""
        return {"queue": self.queue, "target": self.target, "options": dict(self.options),
                "overrides": self.overrides(), "on_demand": self.on_demand,
                "idle_unload_s": self.idle_unload_s, "memory": self.memory_bytes}


@dataclass(frozen=True)
class HostSpec:
    """A host file, read and checked."""

    path: str
    #: the devices as ``--devices`` takes them (``cpu``, ``cuda:0,cuda:1``, ``all``)
    devices: str = "cpu"
    replicas: int = 1
    memory_budget: int | None = None
    max_loaded: int | None = None
    standby: int | None = None
    lease_ms: int | None = None
    engines: tuple[EngineSpec, ...] = ()
    #: the ``[[schedule]]`` tables, as :func:`mtq.client.schedules.put` takes them
    schedules: tuple[dict[str, Any], ...] = ()


def parse_size(value: Any) -> int:
    """Bytes: an int, or a string ``N`` / ``N B|KB|MB|GB|TB|KiB|MiB|GiB|TiB`` (N may have a
    fraction; case does not matter). ValueError naming the accepted forms otherwise."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        m = _SIZE.fullmatch(value)
        if m and m.group(2).lower() in _UNITS:
            return round(float(m.group(1)) * _UNITS[m.group(2).lower()])
    raise ValueError(f"{value!r} is not a size: give an integer of bytes or a string such "
                     "as \"500MiB\" or \"12GiB\" (units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")


def _kind(value: Any) -> str:
    """What a TOML value is, in messages."""
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, (int, float)):
        return f"a number ({value!r})"
    if isinstance(value, str):
        return f"a string ({value!r})"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "an array"
    return type(value).__name__


class _Checker:
    """Reads the parsed document, failing with the file and line of the key at fault."""

    def __init__(self, name: str, text: str) -> None:
        self.name = name
        self.lines = key_lines(text)

    def fail(self, path: Path, message: str) -> NoReturn:
        line = line_of(self.lines, path)
        raise HostFileError(f"{self.name}:{line}: {message}" if line else
                            f"{self.name}: {message}")

    @staticmethod
    def table_name(path: Path) -> str:
        if path[0] in ("engine", "schedule") and len(path) >= 2:
            rest = "".join(f".{p}" for p in path[2:])
            return f"[[{path[0]}]] {int(path[1]) + 1}{rest}"
        return "[" + ".".join(map(str, path)) + "]"

    def keys(self, table: Mapping[str, Any], path: Path, known: tuple[str, ...]) -> None:
        where = f"in {self.table_name(path)}" if path else "at the top level"
        for key in table:
            if key not in known:
                close = difflib.get_close_matches(key, known, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                self.fail((*path, key), f"unknown key {key!r} {where}{hint}; "
                                        f"known keys: {', '.join(known)}")

    def int_(self, path: Path, value: Any, lo: int, hi: int | None = None) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or value < lo or \
                (hi is not None and value > hi):
            span = f"{lo}..{hi}" if hi is not None else f">= {lo}"
            self.fail(path, f"{path[-1]} must be an integer {span}, got {_kind(value)}")
        return value

    def number(self, path: Path, value: Any, lo: float, hi: float | None = None, *,
               above: bool = False) -> float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and \
            math.isfinite(value) and (value > lo if above else value >= lo) and \
            (hi is None or value <= hi)
        if not ok:
            span = f"> {lo:g}" if above else f">= {lo:g}"
            if hi is not None:
                span = f"in {lo:g}..{hi:g}"
            self.fail(path, f"{path[-1]} must be a number {span}, got {_kind(value)}")
        return float(value)

    def size(self, path: Path, value: Any) -> int:
        try:
            n = parse_size(value)
        except ValueError as exc:
            self.fail(path, f"{path[-1]}: {exc}")
        if n < 1:
            self.fail(path, f"{path[-1]} must be at least 1 byte, got {value!r}")
        return n

    def bool_(self, path: Path, value: Any) -> bool:
        if not isinstance(value, bool):
            self.fail(path, f"{path[-1]} must be true or false, got {_kind(value)}")
        return value

    def str_(self, path: Path, value: Any) -> str:
        if not isinstance(value, str) or not value.strip():
            self.fail(path, f"{path[-1]} must be a non-empty string, got {_kind(value)}")
        return value.strip()


def _devices(ck: _Checker, value: Any) -> str:
    """``devices``: a string as --devices takes it, or a list of device names; each
    CUDA device must exist on this machine."""
    from mtq.workers import devices

    path: Path = ("host", "devices")
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        spec = ",".join(value)
    elif isinstance(value, str):
        spec = value
    else:
        ck.fail(path, f"devices must be a string (cpu, cuda:0,cuda:1 or all) or a list of "
                      f"device names, got {_kind(value)}")
    try:
        names = devices.parse_devices(spec)
    except MtqError as exc:
        ck.fail(path, str(exc).replace("--devices", "devices"))
    wanted = [int(d.partition(":")[2]) for d in names if d.startswith("cuda:")]
    if wanted:
        count = devices.cuda_count()
        for n in wanted:
            if n >= count:
                have = (f"{count} CUDA device(s) (cuda:0..cuda:{count - 1})" if count else
                        "no CUDA device torch can use")
                ck.fail(path, f"device cuda:{n} does not exist: this machine has {have}; "
                              "use devices = \"all\" for every GPU, or \"cpu\"")
    return ",".join(names)


def _host(ck: _Checker, table: Any) -> dict[str, Any]:
    if not isinstance(table, dict):
        ck.fail(("host",), f"host must be a table ([host]), got {_kind(table)}")
    ck.keys(table, ("host",), HOST_KEYS)
    out: dict[str, Any] = {}
    for key, value in table.items():
        path: Path = ("host", key)
        if key == "devices":
            out[key] = _devices(ck, value)
        elif key == "replicas":
            out[key] = ck.int_(path, value, 0, 256)
        elif key == "memory_budget":
            out[key] = ck.size(path, value)
        elif key == "max_loaded":
            out[key] = ck.int_(path, value, 1)
        elif key == "standby":
            out[key] = ck.int_(path, value, 0, 1)
        elif key == "lease_ms":
            out[key] = ck.int_(path, value, 100)
    return out


def _options(ck: _Checker, path: Path, value: Any) -> dict[str, str]:
    """The model options as ``--set`` text: strings, numbers and booleans only."""
    if not isinstance(value, dict):
        ck.fail(path, f"options must be a table (options = {{ model = \"...\" }}), got "
                      f"{_kind(value)}")
    out: dict[str, str] = {}
    for key, v in value.items():
        if isinstance(v, bool):
            out[key] = "true" if v else "false"
        elif isinstance(v, (int, str)) or (isinstance(v, float) and math.isfinite(v)):
            out[key] = str(v)
        else:
            ck.fail((*path, key), f"option {key!r} must be a string, a number or true/false, "
                                  f"got {_kind(v)}")
    return out


def _engine(ck: _Checker, index: int, table: Any) -> EngineSpec:
    from mtq.validation import check_queue_name

    here: Path = ("engine", index)
    name = ck.table_name(here)
    if not isinstance(table, dict):
        ck.fail(here, f"{name} must be a table, got {_kind(table)}")
    ck.keys(table, here, ENGINE_KEYS)
    for key in ("queue", "target"):
        if key not in table:
            ck.fail(here, f"{name} has no {key}: every engine needs queue = \"...\" and "
                          "target = \"package.module:attr\"")
    fields: dict[str, Any] = {"line": line_of(ck.lines, here)}
    for key, value in table.items():
        path: Path = (*here, key)
        if key == "queue":
            queue = ck.str_(path, value)
            try:
                check_queue_name(queue)
            except MtqError as exc:
                ck.fail(path, str(exc))
            fields["queue"] = queue
        elif key == "target":
            fields["target"] = ck.str_(path, value)
        elif key == "options":
            fields["options"] = _options(ck, path, value)
        elif key == "max_batch_size":
            fields["max_batch_size"] = ck.int_(path, value, 1, 100_000)
        elif key == "max_wait_ms":
            fields["max_wait_ms"] = ck.number(path, value, 0, 60_000)
        elif key == "timeout":
            fields["timeout_s"] = ck.number(path, value, 0.001)
        elif key == "on_demand":
            fields["on_demand"] = ck.bool_(path, value)
        elif key == "idle_unload_s":
            fields["idle_unload_s"] = ck.number(path, value, 0, above=True)
        elif key == "memory":
            fields["memory_bytes"] = ck.size(path, value)
    return EngineSpec(**fields)


def _schedules(ck: _Checker, tables: Any) -> tuple[dict[str, Any], ...]:
    """The ``[[schedule]]`` tables, each checked as ``mtq schedule add`` checks it."""
    from mtq.client.schedules import check

    if not isinstance(tables, list):
        ck.fail(("schedule",), "schedule must be an array of tables: write each as "
                               "[[schedule]]")
    out: list[dict[str, Any]] = []
    for i, table in enumerate(tables):
        here: Path = ("schedule", i)
        if not isinstance(table, dict):
            ck.fail(here, f"{ck.table_name(here)} must be a table, got {_kind(table)}")
        ck.keys(table, here, SCHEDULE_KEYS)
        for key in ("name", "queue", "cron", "payload"):
            if key not in table:
                ck.fail(here, f"{ck.table_name(here)} has no {key}: a schedule needs name, "
                              "queue, cron and payload")
        args = {"stream": None, "tenant": None, "tz": "UTC", "catch_up": "latest", **table}
        try:
            check(**args)
        except MtqError as exc:
            ck.fail(here, str(exc))
        if any(s["name"] == table["name"] for s in out):
            ck.fail((*here, "name"), f"schedule {table['name']!r} is named twice")
        out.append(args)
    return tuple(out)


def _target(ck: _Checker, index: int, engine: EngineSpec) -> None:
    """The target's module can be found; its options, when some are given (or it is a
    target mtq ships), are ones it declares and takes (importing its module, as
    ``--set`` does)."""
    from mtq.workers.target import ALIASES, check_options, find_target_module

    here: Path = ("engine", index)
    try:
        find_target_module(engine.target)
    except MtqError as exc:
        ck.fail((*here, "target"), str(exc))
    if engine.options or engine.target.partition(":")[0] in ALIASES:
        try:
            check_options(engine.target, dict(engine.options))
        except MtqError as exc:
            at = "options" if engine.options and isinstance(exc, OptionError) else "target"
            ck.fail((*here, at), str(exc).replace("give it with --set ",
                                                  "give it in the engine's options: "))


def _budget(ck: _Checker, host: Mapping[str, Any], engines: list[EngineSpec]) -> None:
    """The engines loaded at start (on_demand = false) fit the budget."""
    eager = [e for e in engines if not e.on_demand]
    most = host.get("max_loaded")
    if most is not None and len(eager) > most:
        ck.fail(("host", "max_loaded"),
                f"max_loaded = {most}, but {len(eager)} engines load at start "
                f"({', '.join(e.queue for e in eager)}): set on_demand = true on all but "
                f"{most} of them, or raise max_loaded")
    budget = host.get("memory_budget")
    if budget is None:
        return
    for i, e in enumerate(engines):
        if e.memory_bytes is not None and e.memory_bytes > budget:
            ck.fail(("engine", i, "memory"),
                    f"queue {e.queue!r}: memory = {e.memory_bytes} bytes is more than the "
                    f"host's memory_budget ({budget} bytes): it could never load")
    known = sum(e.memory_bytes or 0 for e in eager)
    if known > budget:
        ck.fail(("host", "memory_budget"),
                f"memory_budget = {budget} bytes, but the engines that load at start "
                f"need {known} by their memory: set on_demand = true on some, or raise "
                "memory_budget")


def parse(text: str, name: str = "host.toml") -> HostSpec:
    """Read and check a host file's ``text`` (``name``: the file, for messages).
    Raises HostFileError."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # the same module, before it joined the standard library
        import tomli as tomllib  # type: ignore[import-not-found,unused-ignore]

    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        msg = str(exc)
        m = re.search(r"\s*\(at line (\d+), column (\d+)\)$", msg)
        if m:
            raise HostFileError(f"{name}:{m.group(1)}: TOML syntax error at column "
                                f"{m.group(2)}: {msg[:m.start()]}") from None
        raise HostFileError(f"{name}: TOML syntax error: {msg}") from None
    ck = _Checker(name, text)
    ck.keys(doc, (), TOP_KEYS)
    host = _host(ck, doc.get("host", {}))
    tables = doc.get("engine")
    if tables is None:
        ck.fail((), "no [[engine]] table: give one per queue, with queue = \"...\" and "
                    "target = \"package.module:attr\"")
    if not isinstance(tables, list):
        ck.fail(("engine",), "engine must be an array of tables: write each as [[engine]]")
    if not tables:
        ck.fail(("engine",), "engine is empty: give one [[engine]] per queue, with "
                             "queue = \"...\" and target = \"package.module:attr\"")
    engines = [_engine(ck, i, t) for i, t in enumerate(tables)]
    seen: dict[str, int] = {}
    for i, e in enumerate(engines):
        if e.queue in seen:
            ck.fail(("engine", i, "queue"), f"queue {e.queue!r} is served twice: [[engine]] "
                    f"{seen[e.queue] + 1} (line {engines[seen[e.queue]].line}) serves it "
                    "already; one engine per queue")
        seen[e.queue] = i
    _budget(ck, host, engines)
    for i, e in enumerate(engines):
        _target(ck, i, e)
    schedules = _schedules(ck, doc["schedule"]) if "schedule" in doc else ()
    return HostSpec(path=name, engines=tuple(engines), schedules=schedules, **host)


def load(path: str) -> HostSpec:
    """Read and check the host file at ``path``. Raises HostFileError."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise HostFileError(f"{path}: cannot read the host file: "
                            f"{exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise HostFileError(f"{path}:{line}: not UTF-8 text (a TOML file must be)") from None
    return parse(text, path)
