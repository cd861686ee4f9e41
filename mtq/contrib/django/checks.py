"""System checks, run by ``manage.py check`` (and before ``runserver``, ``migrate``):

* ``mtq.E001``: Redis cannot be reached at ``MTQ["REDIS_URL"]`` (else
  ``MTQ_REDIS_URL``), asked with a short timeout (``MTQ["CHECK_TIMEOUT_S"]``, 1 s) so
  a check never hangs. Without either URL mtq uses its embedded server, started on
  demand: nothing to check (``--deploy`` warns, ``mtq.W001``).
* ``mtq.E002``: ``MTQ["WORKERS"]`` names a target whose module cannot be found, or
  whose module does not define the attribute. The module is found, and its source
  read, without running it (a model module imports torch, which the web process
  must not pay for); a parent package is imported, as Python's import system does.
* ``mtq.E003``: the ``MTQ`` setting itself is wrong (unknown key, bad value).

A project whose build step runs ``manage.py`` without Redis (``collectstatic`` in
an image build) can silence E001 there: ``SILENCED_SYSTEM_CHECKS = ["mtq.E001"]``.
"""

from __future__ import annotations

import ast
import importlib.util
from typing import Any

import redis
from django.core import checks
from redis.backoff import NoBackoff
from redis.retry import Retry

from mtq.broker.connection import open_client, safe_url
from mtq.contrib.django.conf import MtqSettingsError, get_settings, redis_url
from mtq.errors import ConfigError, MtqError, RedisUnavailable
from mtq.settings import RedisSettings

TAG = "mtq"


def _settings_or_error() -> tuple[Any, list[checks.CheckMessage]]:
    try:
        return get_settings(), []
    except MtqSettingsError as exc:
        return None, [checks.Error(str(exc), hint="Fix the MTQ setting in settings.py "
                                   "(docs/web.md, 'Django in ten lines').", id="mtq.E003")]


@checks.register(TAG)
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """mtq.E003: the MTQ setting is valid."""
    return _settings_or_error()[1]


@checks.register(TAG)
def check_redis(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """mtq.E001: Redis answers PING within ``CHECK_TIMEOUT_S``."""
    conf, _ = _settings_or_error()
    if conf is None:
        return []  # E003 says it
    url = redis_url()
    if not url:
        return []
    timeout = conf.check_timeout_s
    error: RedisUnavailable | None = None
    try:  # a client of its own: no retries, a short timeout, closed after
        client = open_client(url, RedisSettings(socket_timeout=timeout, connect_timeout=timeout),
                             None, retry=Retry(NoBackoff(), 0))
    except ConfigError as exc:
        return [checks.Error(f"MTQ REDIS_URL {safe_url(url)!r} is not a Redis URL: {exc}",
                             hint="Write it as redis://host:port/db, rediss://..., "
                                  "redis+cluster://host:port,host:port or "
                                  "redis+sentinel://host:port/service (docs/scaling.md).",
                             id="mtq.E001")]
    except RedisUnavailable as exc:  # a cluster whose nodes do not answer
        client, error = None, exc
    try:
        if client is None:
            raise redis.ConnectionError(str(error))
        client.ping()
    except redis.RedisError as exc:
        source = "MTQ['REDIS_URL']" if conf.redis_url else "the MTQ_REDIS_URL variable"
        return [checks.Error(
            f"cannot reach Redis at {safe_url(url)} ({source}) within {timeout:g} s: "
            f"{type(exc).__name__}: {exc}",
            hint="Start redis-server there, or point MTQ['REDIS_URL'] (or MTQ_REDIS_URL) at "
                 "a running one; submits and event streams fail until it answers.",
            id="mtq.E001")]
    finally:
        if client is not None:
            client.close()
    return []


@checks.register(TAG, deploy=True)
def check_deploy(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """mtq.W001 (``--deploy``): no Redis URL configured: the embedded server."""
    conf, _ = _settings_or_error()
    if conf is None or redis_url():
        return []
    return [checks.Warning(
        "no Redis URL is configured: mtq uses its embedded redis-server, a private one "
        "per machine user, which other hosts (workers) cannot reach",
        hint="Set MTQ['REDIS_URL'] (or the MTQ_REDIS_URL variable) to your Redis.",
        id="mtq.W001")]


def _defines(path: str, attr: str) -> bool | None:
    """Whether the module source at ``path`` binds ``attr`` at top level (None: cannot
    tell, e.g. a ``from x import *`` or a compiled module)."""
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return None
    names: set[str] = set()
    for node in tree.body:
        names |= _bound(node)
        if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names):
            return None
        if isinstance(node, (ast.If, ast.Try)):  # if TYPE_CHECKING / try: import
            for sub in ast.walk(node):
                names |= _bound(sub)
    if attr in names:
        return True
    return None if "__getattr__" in names else False


def _bound(node: ast.AST) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    if isinstance(node, ast.Assign):
        return {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    if isinstance(node, (ast.AnnAssign, ast.AugAssign)) and isinstance(node.target, ast.Name):
        return {node.target.id}
    return set()


@checks.register(TAG)
def check_workers(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """mtq.E002: ``MTQ["WORKERS"]``, if set, names a module that exists and defines
    the target's attribute (read, not run)."""
    from mtq.workers.target import find_target_module

    conf, _ = _settings_or_error()
    if conf is None or conf.workers is None:
        return []
    target = conf.workers
    hint = ("Fix MTQ['WORKERS'] ('package.module:attr', importable from where manage.py "
            "mtq_workers runs: the project directory or PYTHONPATH), or remove it.")
    try:
        find_target_module(target)
    except MtqError as exc:
        return [checks.Error(f"MTQ['WORKERS']: {exc}", hint=hint, id="mtq.E002")]
    module, _, attr = target.partition(":")
    spec = importlib.util.find_spec(module)
    origin = spec.origin if spec is not None else None
    if origin and origin.endswith(".py") and _defines(origin, attr.split(".")[0]) is False:
        return [checks.Error(f"MTQ['WORKERS']: module {module!r} ({origin}) defines no "
                             f"{attr.split('.')[0]!r} for target {target!r}",
                             hint=hint, id="mtq.E002")]
    return []
