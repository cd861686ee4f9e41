"""The web dashboard: ``mtq dashboard --web``, and ``/dashboard`` of ``mtq serve``
(see docs/dashboard.md). ``create_dashboard`` is :func:`mtq.dashboard.web.app.create_dashboard`
(loaded when first used: it needs the ``web`` extra)."""

from __future__ import annotations

from typing import Any

__all__ = ["create_dashboard"]


def __getattr__(name: str) -> Any:
    if name == "create_dashboard":
        from mtq.dashboard.web.app import create_dashboard

        return create_dashboard
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
