"""A small Starlette app around the web dashboard's access rules and actions
(:func:`mtq.dashboard.web.auth.routes`) for their tests: the routes, ``app.state.client``,
and one page per queue with the forms the dashboard's pages carry (pause, resume,
drain, scale; sign in and out) and the flash an action leaves. Served by uvicorn in
the browser test (``uvicorn --factory tests.support.dashboard_access:from_env``)."""

from __future__ import annotations

import os
from html import escape
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse
from starlette.routing import Mount, Route

from mtq.dashboard.web import auth


def _form(request: Request, action: str, label: str, extra: str = "") -> str:
    root = request.scope.get("root_path", "")
    return (f'<form method="post" action="{escape(root + action)}">'
            f'<input type="hidden" name="csrf" value="{escape(auth.csrf_token(request))}">'
            f'<input type="hidden" name="next" value="{escape(request.url.path)}">{extra}'
            f'<button type="submit" id="{escape(label)}">{escape(label)}</button></form>')


async def queue_page(request: Request) -> HTMLResponse:
    queue = request.path_params["queue"]
    key = auth.admin(request)
    note = auth.flash(request)
    parts = [f"<!doctype html><title>{escape(queue)}</title><h1>{escape(queue)}</h1>"]
    if note is not None:
        parts.append(f'<p id="flash" class="{escape(auth.flash_kind(request))}">'
                     f"{escape(note)}</p>")
    if key is None:
        root = request.scope.get("root_path", "")
        parts.append(f'<p id="who">read-only: <a id="signin" href="{escape(root)}/login?'
                     f'next={escape(request.url.path)}">sign in</a></p>')
    else:
        parts.append(f'<p id="who">admin {escape(key.id)}</p>')
        parts.append(_form(request, "/logout", "signout"))
    for cmd in ("pause", "resume", "drain"):
        parts.append(_form(request, f"/queues/{queue}/{cmd}", cmd))
    parts.append(_form(request, f"/queues/{queue}/scale", "scale",
                       '<input name="replicas" id="replicas" value="1">'))
    return HTMLResponse("".join(parts))


def make_app(client: Any, *, origin: str | None = None, mount: str = "") -> Starlette:
    """The app (at ``mount``, e.g. ``/dashboard``, of an outer app when given)."""
    inner = Starlette(routes=[Route("/queues/{queue}", queue_page), *auth.routes()])
    inner.state.client = client
    auth.configure(inner, origin=origin)
    if not mount:
        return inner
    outer = Starlette(routes=[Mount(mount, app=inner)])
    outer.state.client = client
    return outer


def from_env() -> Starlette:
    """The app over ``MTQ_REDIS_URL`` (for uvicorn's ``--factory``)."""
    from mtq.broker.connection import connect

    return make_app(connect(os.environ["MTQ_REDIS_URL"]),
                    origin=os.environ.get("MTQ_DASHBOARD_ORIGIN") or None)
