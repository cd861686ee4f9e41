"""The ``MTQ`` setting of a Django project, read and checked in one place.

::

    MTQ = {
        "REDIS_URL": "redis://localhost:6379/0",  # default: MTQ_REDIS_URL, else the embedded server
        "QUEUE": "chat",                          # the default queue ("default")
        "WORKERS": "myapp.models:Chat",           # the target of manage.py mtq_workers
        "RETRY_AFTER_S": 2,                       # Retry-After of a 503 (full queue)
        "KEEPALIVE_S": 15.0,                      # seconds between keep-alive comments
        "STREAM_OF": "myapp.streams.stream_of",   # request -> stream name (or a callable)
        "TENANT_OF": "myapp.streams.tenant_of",   # request -> tenant name (or a callable)
        "PRIORITY_OF": "myapp.streams.priority_of",  # request -> priority (or a callable)
        "CHECK_TIMEOUT_S": 1.0,                   # how long mtq.E001 waits for Redis
    }

Every key is optional; an unknown key or a value of the wrong type raises
:class:`MtqSettingsError` (both mtq's ConfigError and Django's
ImproperlyConfigured), and ``manage.py check`` reports it as ``mtq.E003``: a
misspelled ``REDIS_UR`` must not quietly fall back to another Redis.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from django.conf import settings as django_settings
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from mtq.contrib.sse import KEEPALIVE_S, RETRY_AFTER_S
from mtq.errors import ConfigError, InvalidName
from mtq.validation import check_queue_name

#: the name of the Django setting
SETTING = "MTQ"


class MtqSettingsError(ConfigError, ImproperlyConfigured):
    """The ``MTQ`` setting is wrong: an unknown key, a value of the wrong type, a
    ``STREAM_OF`` (``TENANT_OF``, ``PRIORITY_OF``) that cannot be imported. The
    message names the key."""


@dataclass(frozen=True)
class MtqSettings:
    """The ``MTQ`` setting, checked. See the module docstring for the keys."""

    redis_url: str | None = None
    queue: str = "default"
    workers: str | None = None
    retry_after_s: int = RETRY_AFTER_S
    keepalive_s: float = KEEPALIVE_S
    stream_of: Callable[[Any], str | None] | None = None
    check_timeout_s: float = 1.0
    tenant_of: Callable[[Any], str | None] | None = None
    priority_of: Callable[[Any], str | None] | None = None

    @classmethod
    def from_dict(cls, raw: Any) -> MtqSettings:
        """Build from a settings dict. Raises MtqSettingsError, naming the key."""
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            raise MtqSettingsError(f"settings.MTQ must be a dict, got {type(raw).__name__}")
        known = {"REDIS_URL", "QUEUE", "WORKERS", "RETRY_AFTER_S", "KEEPALIVE_S",
                 "STREAM_OF", "TENANT_OF", "PRIORITY_OF", "CHECK_TIMEOUT_S"}
        unknown = sorted(str(k) for k in raw if k not in known)
        if unknown:
            raise MtqSettingsError(f"unknown key(s) in settings.MTQ: {', '.join(unknown)} "
                                   f"(known: {', '.join(sorted(known))})")

        def text(key: str, default: str | None) -> str | None:
            value = raw.get(key, default)
            if value is not None and (not isinstance(value, str) or not value):
                raise MtqSettingsError(f"settings.MTQ[{key!r}] must be a non-empty string, "
                                       f"got {value!r}")
            return value

        def number(key: str, default: float, lo: float, hi: float) -> float:
            value = raw.get(key, default)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not lo <= value <= hi:
                raise MtqSettingsError(f"settings.MTQ[{key!r}] must be a number from {lo:g} "
                                       f"to {hi:g}, got {value!r}")
            return float(value)

        queue = text("QUEUE", "default") or "default"
        try:
            check_queue_name(queue)
        except InvalidName as exc:
            raise MtqSettingsError(f"settings.MTQ['QUEUE']: {exc}") from None
        workers = text("WORKERS", None)
        if workers is not None and workers.count(":") != 1:
            raise MtqSettingsError(f"settings.MTQ['WORKERS'] must name a worker target as "
                                   f"'package.module:attr', got {workers!r}")
        retry_after = number("RETRY_AFTER_S", RETRY_AFTER_S, 0, 86_400)
        if retry_after != int(retry_after):
            raise MtqSettingsError(f"settings.MTQ['RETRY_AFTER_S'] must be whole seconds, "
                                   f"got {retry_after!r}")
        def request_map(key: str) -> Callable[[Any], str | None] | None:
            fn = raw.get(key)
            if isinstance(fn, str):
                try:
                    fn = import_string(fn)
                except ImportError as exc:
                    raise MtqSettingsError(f"settings.MTQ[{key!r}] cannot be imported: "
                                           f"{exc}") from None
            if fn is not None and not callable(fn):
                raise MtqSettingsError(f"settings.MTQ[{key!r}] must be a callable taking the "
                                       f"request (or its dotted path), got {fn!r}")
            return fn

        return cls(redis_url=text("REDIS_URL", None), queue=queue, workers=workers,
                   retry_after_s=int(retry_after),
                   keepalive_s=number("KEEPALIVE_S", KEEPALIVE_S, 0.01, 3600),
                   stream_of=request_map("STREAM_OF"),
                   check_timeout_s=number("CHECK_TIMEOUT_S", 1.0, 0.01, 60),
                   tenant_of=request_map("TENANT_OF"),
                   priority_of=request_map("PRIORITY_OF"))


@functools.lru_cache(maxsize=1)
def get_settings() -> MtqSettings:
    """The project's ``MTQ`` setting, checked once per process (and again after
    ``override_settings`` changes it). Raises MtqSettingsError."""
    return MtqSettings.from_dict(getattr(django_settings, SETTING, None))


def redis_url() -> str | None:
    """The Redis URL the project names: ``MTQ["REDIS_URL"]``, else the ``MTQ_REDIS_URL``
    environment variable (read here, as mtq reads it), else None: mtq's embedded
    server. Raises MtqSettingsError."""
    return get_settings().redis_url or os.environ.get("MTQ_REDIS_URL") or None
