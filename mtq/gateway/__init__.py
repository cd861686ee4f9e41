"""mtq's OpenAI-compatible gateway (``mtq serve``; the ``web`` extra): a Starlette
application that answers the OpenAI API over mtq queues. See docs/gateway.md.

``create_app`` is imported on first use: importing the package loads no web server.
The API keys it checks are :mod:`mtq.client.apikeys` (``mtq keys``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mtq.gateway.app import create_app

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from mtq.gateway.app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
