"""A queue's settings, stored in Redis (``mtq:{queue}:config``), read by every
producer and worker of the queue.

The stored hash holds only the settings someone set (``mtq queue config Q KEY
VALUE``, :func:`store`); the others have :class:`~mtq.settings.QueueSettings`'s
defaults. A process's settings for a queue are, from the weakest:

1. the defaults;
2. the queue's stored settings, read at first use and again every
   :data:`REFRESH_S` seconds, so a change reaches every process within that;
3. overrides given in code (``mtq.Queue("q", max_retries=5)``) or on a worker's
   command line (``--lease-ms``), for that process only.

A :class:`~mtq.settings.QueueSettings` object given in code is used as it is, and the
stored settings are not read (a test, or a process that wants fixed settings).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import redis

from mtq.broker.cluster import for_queue, shared
from mtq.broker.connection import redis_errors, single_attempt
from mtq.broker.keys import QUEUES, QueueKeys
from mtq.errors import BrokerError, ConfigError
from mtq.settings import QueueSettings

log = logging.getLogger(__name__)

#: how often a process reads its queues' stored settings again, in seconds
REFRESH_S = 10.0

#: what a process is given: fixed settings, overrides on top of the stored ones, or
#: None (the stored ones)
SettingsSpec = QueueSettings | Mapping[str, Any] | None

_FIELDS = {f.name: f for f in dataclasses.fields(QueueSettings)}
_TRUE, _FALSE = {"true", "yes", "on", "1"}, {"false", "no", "off", "0"}


def parse(name: str, text: str | bytes) -> Any:
    """A setting's value from its text (as stored, or as typed on the command line).
    Raises ConfigError naming the key and what it takes."""
    if name not in _FIELDS:
        raise ConfigError(f"unknown queue setting {name!r}; known settings are "
                          f"{', '.join(sorted(_FIELDS))}")
    value = text.decode() if isinstance(text, bytes) else str(text)
    kind = _FIELDS[name].type
    if kind in ("bool", bool):
        low = value.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ConfigError(f"{name} takes true or false, got {value!r}")
    if kind in ("str", str):
        return value
    if kind in ("float", float):
        try:
            return float(value.replace("_", ""))
        except ValueError:
            raise ConfigError(f"{name} takes a number, got {value!r}") from None
    try:
        return int(value.replace("_", ""))
    except ValueError:
        raise ConfigError(f"{name} takes a whole number, got {value!r}") from None


def text(value: Any) -> str:
    """How a value is stored (and shown): booleans as true/false, a mapping (tenant
    weights, rate limits) as ``key=value,...``."""
    if isinstance(value, Mapping):
        return ",".join(f"{k}={v!r}" if isinstance(v, float) else f"{k}={v}"
                        for k, v in sorted(value.items()))
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def read(client: redis.Redis, queue: str) -> dict[str, Any]:
    """The queue's stored settings (only those that were set), parsed. A key this
    version does not know (set by a newer mtq) is skipped with a warning."""
    with redis_errors("while reading the queue's settings"):
        raw = client.hgetall(QueueKeys(queue).config)
    out: dict[str, Any] = {}
    for k, v in raw.items():
        name = k.decode() if isinstance(k, bytes) else str(k)
        try:
            value = parse(name, v)
            QueueSettings.from_dict({name: value})  # its range, on its own
        except ConfigError as exc:
            log.warning("queue %r: stored setting ignored (%s); fix it with 'mtq queue "
                        "config %s %s VALUE' or '--reset %s'", queue, exc, queue, name, name)
            continue
        out[name] = value
    return out


def store(client: redis.Redis, queue: str, changes: Mapping[str, Any],
          reset: Iterable[str] = ()) -> QueueSettings:
    """Set some of the queue's stored settings and forget others (``reset``: back to
    their defaults), in one transaction, after checking that the result is valid;
    the queue is listed by ``mtq status`` from then on. Returns the queue's settings
    as stored (overrides in code not included). Raises ConfigError, writing nothing,
    for an unknown key or a value out of range."""
    parsed = {name: parse(name, text(v)) for name, v in changes.items()}
    reset = list(reset)
    unknown = sorted(set(reset) - set(_FIELDS))
    if unknown:
        raise ConfigError(f"unknown queue setting(s) {', '.join(unknown)}; known settings "
                          f"are {', '.join(sorted(_FIELDS))}")
    stored = read(client, queue)
    stored.update(parsed)
    for name in reset:
        stored.pop(name, None)
    settings = QueueSettings.from_dict(stored)  # the range checks
    key = QueueKeys(queue).config
    with redis_errors("while storing the queue's settings"):
        # one transaction on one Redis; on a cluster the list of queues is in another
        # slot, so it is written just after (a queue listed late, at worst)
        own = for_queue(client, queue)
        apart = shared(own) is not own
        pipe = own.pipeline(transaction=True)
        if reset:
            pipe.hdel(key, *reset)
        if parsed:
            pipe.hset(key, mapping={k: text(v) for k, v in parsed.items()})
        if not apart:
            pipe.sadd(QUEUES, queue)
        pipe.execute()
        if apart:
            shared(own).sadd(QUEUES, queue)
    return settings


class SettingsSource:
    """The settings of one queue in one process (see the module's docstring):
    :meth:`get` is cheap (a clock read) between refreshes. Thread-safe."""

    def __init__(self, client: redis.Redis, queue: str, spec: SettingsSpec = None) -> None:
        self.client, self.queue = client, queue
        self.fixed: QueueSettings | None = None
        self.overrides: dict[str, Any] = {}
        if isinstance(spec, QueueSettings):
            self.fixed = spec
        elif spec is not None:
            self.overrides = dict(spec)
        if self.overrides:  # bad overrides are refused at once, before any Redis call
            QueueSettings().replace(**self.overrides)
        self._current: QueueSettings | None = self.fixed
        self._read_at = float("-inf")
        self._lock = threading.Lock()

    @classmethod
    def shared(cls, client: redis.Redis, queue: str, spec: SettingsSpec = None
               ) -> SettingsSource:
        """The source of ``queue``'s settings for ``client`` with these overrides, one
        per process: a web app that makes a Queue per request reads the stored
        settings once per REFRESH_S, not once per request. Fixed settings get a source
        of their own (nothing to share)."""
        if isinstance(spec, QueueSettings):
            return cls(client, queue, spec)
        overrides: tuple[tuple[str, Any], ...] = ()
        if spec:  # refused before use as a key, which holds the checked values (hashable:
            # tenant_weights given as a mapping is its text there)
            checked = QueueSettings().replace(**spec)
            overrides = tuple(sorted((k, getattr(checked, k)) for k in spec))
        with _shared_lock:
            per_client = _shared.setdefault(client, {})
            source = per_client.get((queue, overrides))
            if source is None:
                source = per_client[(queue, overrides)] = cls(client, queue, spec)
            return source

    def get(self) -> QueueSettings:
        if self.fixed is not None:
            return self.fixed
        current = self._current
        if current is not None and time.monotonic() - self._read_at < REFRESH_S:
            return current
        return self._read(force=False)

    def refresh(self) -> QueueSettings:
        """Read the stored settings now. If Redis cannot be reached, the settings read
        before stay (tried again after REFRESH_S); with none read yet, the error
        goes to the caller."""
        return self._read(force=True)

    def _read(self, force: bool) -> QueueSettings:
        if self.fixed is not None:
            return self.fixed
        with self._lock:
            # another thread may have read them while this one waited for the lock
            if not force and self._current is not None and \
                    time.monotonic() - self._read_at < REFRESH_S:
                return self._current
            try:
                if self._current is None:
                    stored = read(self.client, self.queue)
                else:  # a re-read tries once: the settings read before do meanwhile
                    with single_attempt():
                        stored = read(self.client, self.queue)
            except BrokerError:  # Redis away (read raises nothing else of mtq's)
                if self._current is None:
                    raise
                self._read_at = time.monotonic()
                log.debug("queue %r: settings not re-read; keeping the last", self.queue)
                return self._current
            self._current = QueueSettings.from_dict({**stored, **self.overrides})
            self._read_at = time.monotonic()
            return self._current

    def spec(self) -> QueueSettings | dict[str, Any] | None:
        """What another process needs to resolve the same settings (a worker's outlet
        or a supervisor's children): the fixed settings, else the overrides."""
        if self.fixed is not None:
            return self.fixed
        return dict(self.overrides) or None


_SharedKey = tuple[str, tuple[tuple[str, Any], ...]]  # (queue, sorted overrides)
_shared: weakref.WeakKeyDictionary[redis.Redis, dict[_SharedKey, SettingsSource]] = \
    weakref.WeakKeyDictionary()
_shared_lock = threading.Lock()


def to_wire(source: SettingsSource) -> dict[str, Any]:
    """``source``'s spec as plain data, for another process (see :func:`from_wire`)."""
    spec = source.spec()
    if isinstance(spec, QueueSettings):
        return {"fixed": dataclasses.asdict(spec)}
    return {"overrides": spec or {}}


def from_wire(data: Mapping[str, Any] | None) -> SettingsSpec:
    """The spec :func:`to_wire` wrote (None or {}: the stored settings)."""
    if not data:
        return None
    if data.get("fixed") is not None:
        return QueueSettings.from_dict(data["fixed"])
    return dict(data.get("overrides") or {}) or None
