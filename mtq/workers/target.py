"""Loading a worker target named ``package.module:attr``."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from mtq.errors import TargetError


def load_target(spec: str) -> Callable[..., Any]:
    """Import ``package.module:attr`` and return the attribute.

    Raises TargetError (at start-up, not in a crash loop) when the spec is
    malformed, the module cannot be imported or the attribute is missing or not callable.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise TargetError(f"bad target {spec!r}: write it as package.module:attr, "
                          "e.g. myapp.models:embed")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise TargetError(f"cannot import {module_name!r} for target {spec!r}: "
                          f"{type(exc).__name__}: {exc} (is it on PYTHONPATH?)") from exc
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise TargetError(f"module {module_name!r} has no attribute {attr!r} "
                              f"(target {spec!r})") from None
    if not callable(obj):
        raise TargetError(f"target {spec!r} is a {type(obj).__name__}, not a callable")
    return obj
