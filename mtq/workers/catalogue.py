"""A served model's version and its catalogue record (see mtq.broker.catalogue).

The version is the target's ``version`` class attribute when it sets one (anything
but the default ``"0"``); otherwise a digest computed once after ``setup``: of the
target's source file and, when torch is already imported (never imported here), of
the tensors reachable from the model (``nn.Module`` attributes' state_dicts and
tensor attributes; or what its ``weights_digest()`` returns, when it has one: the
Hugging Face backends give their hub commit or their folder's files), and of the
options it was given (``--set``); a declared version given options gets their digest
appended. A reload of changed code, weights or
options so yields a new version,
and the result cache (keyed on it) never answers from the old model.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
import socket
import sys
import time
from typing import Any

from mtq.broker import catalogue as broker_catalogue
from mtq.broker.consumer import Consumer
from mtq.errors import BrokerError, RedisUnavailable
from mtq.workers.generator import Generator
from mtq.workers.model import FunctionModel
from mtq.workers.options import given, given_json

log = logging.getLogger(__name__)

#: versions computed here start with this (a declared version never needs to)
COMPUTED = "h-"


def kind(model: Any) -> str:
    """'generator', 'function' or 'model'."""
    if isinstance(model, Generator):
        return "generator"
    return "function" if isinstance(model, FunctionModel) else "model"


def _source(model: Any) -> bytes:
    obj = model.func if isinstance(model, FunctionModel) else type(model)
    try:
        path = inspect.getsourcefile(obj)
        if path:
            with open(path, "rb") as f:
                return f.read()
    except (OSError, TypeError):
        pass
    return repr(obj).encode()


def _tensors(model: Any, h: Any) -> None:
    torch = sys.modules.get("torch")
    if torch is None:
        return
    for name in sorted(vars(model)):
        value = vars(model)[name]
        items: list[tuple[str, Any]] = []
        if isinstance(value, torch.nn.Module):
            items = sorted(value.state_dict().items())
        elif isinstance(value, torch.Tensor):
            items = [("", value)]
        for key, t in items:
            t = t.detach().to("cpu").contiguous().reshape(-1)
            h.update(f"{name}.{key}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def version_of(model: Any) -> str:
    """The model's version (see the module docstring); set on the instance, so
    ``describe()`` reports it. Call once, after ``setup``."""
    declared = str(getattr(type(model), "version", "0"))
    if isinstance(model, FunctionModel):
        declared = str(getattr(model.func, "version", "0"))
    options = given(model)
    if declared != "0":
        # the options given change what the same code and weights answer (pooling, say)
        version = declared if not options else \
            f"{declared}+{hashlib.blake2b(given_json(model).encode(), digest_size=4).hexdigest()}"
    else:
        h = hashlib.blake2b(digest_size=8)
        h.update(_source(model))
        if options:  # (a target given none keeps the version it had before options)
            h.update(given_json(model).encode())
        digest = getattr(model, "weights_digest", None)
        if callable(digest):  # the model says what identifies its weights
            h.update(str(digest()).encode())
        else:
            _tensors(model, h)
        version = COMPUTED + h.hexdigest()
    model.version = version
    return version


def model_record(model: Any, target: str, version: str, **where: Any) -> dict[str, Any]:
    """The queue's model record (mtq.broker.catalogue.FIELDS)."""
    return {"target": target, "version": version, "kind": kind(model),
            "deterministic": int(bool(getattr(model, "deterministic", False))),
            "cacheable": int(bool(getattr(model, "cacheable", True))),
            "options": given_json(model), **where}


def record_event(consumer: Consumer, queue: str, event: str, *, spec: str | None,
                 current: Any, model: Any = None, error: str = "", worker: str,
                 device: str, supervisor: str) -> None:
    """Record an engine's ``event`` (loaded, reloaded, unloaded, reload_failed,
    stopped) in the model catalogue (mtq.broker.catalogue); with ``model`` (just set
    up), compute its version, make it the consumer's, and make its record the queue's.
    ``current``: the model served now (named when there is no target name). A
    catalogue that cannot be written is logged, never fatal."""
    now = int(time.time() * 1000)
    where = {"host": socket.gethostname(), "worker": worker}
    target = spec or "/".join(current.describe())
    version = version_of(model) if model is not None else current.describe()[1]
    if model is not None:
        consumer.broker.model_version = version
    fields = {"event": event, "target": target, "version": version, "pid": os.getpid(),
              "device": device, "supervisor": supervisor, "ts": now, **where}
    if model is not None and given(model):
        fields["options"] = given(model)
    if error:
        fields["error"] = error
    try:
        broker_catalogue.record(
            consumer.redis, queue, fields,
            model_record(model, target, version, loaded=now, **where) if model is not None
            else None)
    except BrokerError as exc:
        log.warning("could not write the model catalogue (%s)", exc,
                    exc_info=not isinstance(exc, RedisUnavailable))
