"""Who may act on the web dashboard: reading needs nothing, every action needs an admin
key, and forms are protected against cross-site requests (see docs/dashboard.md,
"Access and actions").

Interface used by the pages (:mod:`mtq.dashboard.web.app`):

* :func:`admin` -- the admin key behind a request (its session cookie, or an
  ``Authorization: Bearer`` header), or None. The first call on a request reads Redis
  (two round trips: the session, then its key), later ones reuse the answer;
* :func:`csrf_token` -- the value a form posted by that admin carries in its ``csrf``
  field. Signed out, it is the pre-session token of the sign-in form (login CSRF:
  double submit of the ``mtq_login`` cookie); a new one is set on the page's response
  by the middleware :func:`configure` installs (without it, the first sign-in is
  refused with a form that works, and ``GET /login`` sets it too);
* :func:`flash` (and :func:`flash_kind`, ``ok`` or ``warning``) -- the message an
  action left for the page it sent the browser back to (None: none). The action
  redirects (303) to its ``next`` with ``?flash=<nonce>`` and sets the short-lived
  cookie ``mtq_flash`` holding that nonce and the message: the page shows it only with
  its own nonce, so a link cannot make a page show a text of its choosing, and it is
  not shown again on the next page;
* :func:`configure` -- ``configure(app, origin=None)``, called once by
  ``create_dashboard`` on its app: the pre-session cookie's middleware, and the
  dashboard's public origin when it is served behind a proxy that changes the Host
  header (``create_dashboard(origin=...)``, ``--origin https://ops.example.com`` of
  ``mtq dashboard --web`` and ``mtq serve``). It is kept in ``app.state.public_origin``; None: the
  request's own scheme and Host are the dashboard's origin;
* :func:`routes` -- ``GET /login`` (the sign-in page), ``POST /login`` (field
  ``key``), ``POST /logout`` and the actions of :mod:`mtq.dashboard.web.actions`,
  each ``POST`` with the form fields ``csrf`` and ``next``, mounted at the dashboard's
  root.

Answers: an action of a browser session answers 303 to ``next`` (a path of the
dashboard, with or without its mount point; anything else is refused, 400, so no one
can use the dashboard to redirect elsewhere) with the flash; one with a Bearer key
answers JSON (``{"ok", "action", "message", ...}``). 409: nothing changed because of
the state of things (no supervisor of the queue is listening, the task had already
ended), said in the flash (kind ``warning``) or the JSON. Refusals, each a page (or
JSON for Bearer) saying what to do, with nothing changed: 400 bad input, 401 no,
unknown, revoked or non-admin key (or an ended session), 403 a missing or wrong CSRF
token or a request from another origin, 404 no such task, 413 a body over 256 KiB,
503 Redis unreachable. Each action is logged (logger ``mtq.dashboard.web``) with the
admin key's id, never its token.
"""

from __future__ import annotations

import base64
import hmac
import json
import logging
import secrets
from html import escape
from typing import Any
from urllib.parse import parse_qsl, urlencode

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import MutableHeaders
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Route

from mtq.client import apikeys
from mtq.dashboard.web import sessions
from mtq.dashboard.web.actions import ACTIONS, Prepare
from mtq.dashboard.web.rules import (
    ORIGIN,
    Refused,
    check_csrf,
    check_origin,
    next_path,
    one,
    read_form,
    refusal_of,
    root,
    secure,
)
from mtq.dashboard.web.sessions import SESSION_COOKIE, SESSION_TTL_S, TOKEN, caller, is_bearer
from mtq.errors import (
    ConfigError,
    InvalidApiKey,
    MtqError,
)

log = logging.getLogger("mtq.dashboard.web")

#: the pre-session token of the sign-in form (login CSRF: double submit)
LOGIN_COOKIE = "mtq_login"
LOGIN_TTL_S = 3600
#: the message an action leaves for the page it sends the browser back to
FLASH_COOKIE = "mtq_flash"
FLASH_TTL_S = 60
# -- the interface the pages use ---------------------------------------------------------
def admin(request: Request) -> apikeys.ApiKey | None:
    """The admin key behind ``request`` (an ApiKey with ``admin`` true), or None (also
    while Redis cannot be reached: the pages stay read-only)."""
    try:
        return caller(request).key
    except MtqError:
        return None


def csrf_token(request: Request) -> str:
    """The CSRF token forms of this admin's session carry; signed out, the sign-in
    form's pre-session token (a new one when the browser has none: the response sets
    its cookie where :func:`configure` was called); "" for a Bearer request or while
    Redis cannot be reached."""
    try:
        found = caller(request)
    except MtqError:
        return ""
    if found.session is not None:
        return found.session.csrf
    if found.bearer:
        return ""
    token = request.cookies.get(LOGIN_COOKIE, "")
    if TOKEN.fullmatch(token):
        return token
    made = getattr(request.state, "mtq_new_login", None)
    if made is None:  # the response sets it (configure's middleware)
        token = secrets.token_urlsafe(32)
        made = request.state.mtq_new_login = (token, _login_cookie(request, token))
    return str(made[0])


def _login_cookie(request: Request, token: str) -> str:
    """The ``Set-Cookie`` value of a pre-session token."""
    resp = Response()
    resp.set_cookie(LOGIN_COOKIE, token, max_age=LOGIN_TTL_S, path=root(request) or "/",
                    httponly=True, samesite="strict", secure=secure(request))
    return resp.headers["set-cookie"]


class _PreSession:
    """ASGI middleware (:func:`configure` installs it): a response to a request for
    which :func:`csrf_token` made a pre-session token sets its cookie, so that the
    sign-in form of any page works at once."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def sending(message: Any) -> None:
            made = (scope.get("state") or {}).get("mtq_new_login")
            if message["type"] == "http.response.start" and made:
                MutableHeaders(scope=message).append("set-cookie", made[1])
            await send(message)

        await self.app(scope, receive, sending)


def _flash(request: Request) -> dict[str, str] | None:
    nonce = request.query_params.get("flash", "")
    stored, _, body = request.cookies.get(FLASH_COOKIE, "").partition(".")
    if not nonce or not stored or not hmac.compare_digest(nonce.encode(), stored.encode()):
        return None
    try:
        value = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
        return {"kind": str(value["kind"]), "text": str(value["text"])}
    except (ValueError, KeyError, TypeError):
        return None


def flash(request: Request) -> str | None:
    """The message the last action left for this page (None: none)."""
    found = _flash(request)
    return found["text"] if found else None


def flash_kind(request: Request) -> str:
    """``ok`` (it was done) or ``warning`` (nothing changed: see the message)."""
    found = _flash(request)
    return found["kind"] if found else "ok"


def configure(app: Any, *, origin: str | None = None) -> None:
    """Call once on the dashboard's app, before it serves: installs the middleware that
    sets the pre-session cookie of the sign-in forms, and sets the dashboard's public
    origin (``https://host[:port]``, as browsers send ``Origin``; None: the request's
    own) for a dashboard behind a proxy that changes the Host header. Raises
    ConfigError for an origin that is not one."""
    if origin is not None:
        if not isinstance(origin, str) or not ORIGIN.fullmatch(origin.rstrip("/")):
            raise ConfigError(f"origin {origin!r}: give the scheme and host the browser "
                              "sees, e.g. https://ops.example.com or http://10.0.0.5:8080 "
                              "(no path)")
        origin = origin.rstrip("/").lower()
    app.state.public_origin = origin
    if not getattr(app.state, "mtq_pre_session", False):
        app.add_middleware(_PreSession)
        app.state.mtq_pre_session = True


# -- answers -----------------------------------------------------------------------------
_STYLE = ("body{font:15px system-ui,sans-serif;max-width:40em;margin:3em auto;padding:0 1em}"
          "p.msg{padding:.6em .8em;border-left:4px solid #c33;background:#fbeeee}"
          "input[type=password]{width:100%;padding:.4em;margin:.4em 0}")


def _page(request: Request, status: int, title: str, message: str, *,
          form: bool = False, nxt: str | None = None) -> HTMLResponse:
    base = root(request)
    back = escape(nxt or base + "/")
    parts = [f"<!doctype html><html lang=en><head><meta charset=utf-8><title>"
             f"{escape(title)} - mtq</title><style>{_STYLE}</style></head><body>",
             f"<h1>{escape(title)}</h1>"]
    if message:
        parts.append(f'<p class="msg" role="alert">{escape(message)}</p>')
    token = request.cookies.get(LOGIN_COOKIE, "")
    if form:
        if not TOKEN.fullmatch(token):
            token = secrets.token_urlsafe(32)
        parts.append(
            f'<form method="post" action="{escape(base)}/login">'
            f'<input type="hidden" name="csrf" value="{escape(token)}">'
            f'<input type="hidden" name="next" value="{back}">'
            '<label>Admin key <input type="password" name="key" autocomplete="off" '
            'placeholder="mtq-..." required></label> '
            '<button type="submit">Sign in</button></form>'
            "<p>An admin key is made with <code>mtq keys create --tenant T --admin</code>. "
            "The dashboard is read-only without one.</p>")
    elif status == 401:
        login = escape(f"{base}/login?" + urlencode({"next": nxt or base + "/"}))
        parts.append(f'<p><a href="{login}">Sign in</a> with an admin key.</p>')
    parts.append(f'<p><a href="{back}">Back to the dashboard</a></p></body></html>')
    resp = HTMLResponse("".join(parts), status)
    if form:
        resp.set_cookie(LOGIN_COOKIE, token, max_age=LOGIN_TTL_S, path=base or "/",
                        httponly=True, samesite="strict", secure=secure(request))
    return resp


def _refusal(request: Request, exc: Refused, bearer: bool, nxt: str | None = None) -> Response:
    if bearer:
        return JSONResponse({"ok": False, "error": str(exc)}, exc.status)
    title = {400: "Bad request", 401: "Sign in first", 403: "Refused", 404: "Not found",
             413: "Too large", 503: "Redis unreachable"}.get(exc.status, "Refused")
    return _page(request, exc.status, title, str(exc), nxt=nxt)


def _back(request: Request, nxt: str, kind: str, text: str) -> RedirectResponse:
    """303 to ``nxt`` with the flash ``text``."""
    nonce = secrets.token_urlsafe(12)
    path, _, query = nxt.partition("?")
    kept = [(k, v) for k, v in parse_qsl(query, keep_blank_values=True) if k != "flash"]
    resp = RedirectResponse(f"{path}?{urlencode([*kept, ('flash', nonce)])}", 303)
    body = base64.urlsafe_b64encode(json.dumps({"kind": kind, "text": text}).encode())
    resp.set_cookie(FLASH_COOKIE, f"{nonce}.{body.decode().rstrip('=')}",
                    max_age=FLASH_TTL_S, path=root(request) or "/", httponly=True,
                    samesite="strict", secure=secure(request))
    return resp


# -- the routes --------------------------------------------------------------------------
async def login_page(request: Request) -> Response:
    """``GET /login``: the sign-in form (it sets the pre-session token)."""
    try:
        nxt = next_path(request, request.query_params.get("next"))
    except Refused:
        nxt = root(request) + "/"
    return _page(request, 200, "Sign in", "", form=True, nxt=nxt)


async def login(request: Request) -> Response:
    """``POST /login``: field ``key``, an admin key's token; makes a session."""
    if is_bearer(request):
        return JSONResponse({"ok": False, "error": "scripts need no session: send the "
                             "admin key as 'Authorization: Bearer' with each action"}, 400)
    nxt: str | None = None
    try:
        check_origin(request)
        form = await read_form(request)
        nxt = next_path(request, one(form, "next"))
        check_csrf(form, request.cookies.get(LOGIN_COOKIE), "this sign-in form")
        client = sessions.client_of(request)
        token = (one(form, "key") or "").strip()  # pasted with blanks around it
        key = await run_in_threadpool(apikeys.authenticate, client, token)
        if not key.admin:
            raise Refused(401, f"API key {key.id} is not an admin key: sign in with one "
                          "('mtq keys create --tenant T --admin' makes one)")
        old = request.cookies.get(SESSION_COOKIE)
        if old:
            await run_in_threadpool(sessions.end, client, old)
        session = await run_in_threadpool(sessions.start, client, key)
    except InvalidApiKey as exc:
        log.info("dashboard sign-in refused: %s", exc.reason)
        return _page(request, 401, "Sign in", f"{exc} (the dashboard needs an admin key: "
                     "'mtq keys create --tenant T --admin')", form=True, nxt=nxt)
    except Refused as exc:
        log.info("dashboard sign-in refused (%d)", exc.status)
        return _page(request, exc.status, "Sign in", str(exc), form=exc.status != 400,
                     nxt=nxt)
    except MtqError as exc:
        return _refusal(request, refusal_of(exc), False, nxt)
    log.info("dashboard sign-in: admin key %s", key.id)
    resp = _back(request, nxt, "ok",
                 f"signed in with admin key {key.id} ({key.name or key.tenant})")
    resp.set_cookie(SESSION_COOKIE, session.id, max_age=SESSION_TTL_S,
                    path=root(request) or "/", httponly=True, samesite="strict",
                    secure=secure(request))
    resp.delete_cookie(LOGIN_COOKIE, path=root(request) or "/")
    return resp


async def logout(request: Request) -> Response:
    """``POST /logout``: ends the browser's session."""
    nxt: str | None = None
    try:
        if is_bearer(request):
            raise Refused(400, "a Bearer key has no session to end (revoke the key: "
                          "'mtq keys revoke ID')")
        check_origin(request)
        form = await read_form(request)
        nxt = next_path(request, one(form, "next"))
        found = await run_in_threadpool(caller, request)
        if found.session is not None:
            check_csrf(form, found.session.csrf, "this sign-out")
            await run_in_threadpool(sessions.end, sessions.client_of(request),
                                    found.session.id)
            log.info("dashboard sign-out: admin key %s", found.session.key_id)
    except Refused as exc:
        return _refusal(request, exc, is_bearer(request), nxt)
    except MtqError as exc:
        return _refusal(request, refusal_of(exc), False, nxt)
    resp = _back(request, nxt, "ok", "signed out: the dashboard is read-only")
    resp.delete_cookie(SESSION_COOKIE, path=root(request) or "/")
    return resp


def _action(name: str, prepare: Prepare) -> Any:
    async def endpoint(request: Request) -> Response:
        bearer = is_bearer(request)
        nxt: str | None = None
        try:
            found = await run_in_threadpool(caller, request)
            if not bearer:
                check_origin(request)
            form = await read_form(request)
            nxt = next_path(request, one(form, "next"))
            if found.key is None:
                raise Refused(401, found.refusal)
            if not bearer:
                check_csrf(form, found.session.csrf if found.session else None,
                            "this form")
            act = prepare(request.path_params, form)   # every input checked: nothing sent yet
            done = await run_in_threadpool(act, sessions.client_of(request))
        except Refused as exc:
            log.info("dashboard %s refused (%d): %s", name, exc.status, exc)
            return _refusal(request, exc, bearer, nxt)
        except MtqError as exc:
            refused = refusal_of(exc)
            log.info("dashboard %s refused (%d): %s", name, refused.status, refused)
            return _refusal(request, refused, bearer, nxt)
        log.info("dashboard %s by admin key %s (%s): %s", name, found.key.id,
                 "bearer" if bearer else "session", done.message)
        if bearer:
            return JSONResponse({"ok": done.status < 400, "action": name,
                                 "message": done.message, **done.data}, done.status)
        return _back(request, nxt or root(request) + "/",
                     "ok" if done.status < 400 else "warning", done.message)
    endpoint.__name__ = f"action_{name.replace('-', '_')}"
    return endpoint


def routes() -> list[BaseRoute]:
    """GET and POST /login, POST /logout and the actions (see the module docstring)."""
    found: list[BaseRoute] = [
        Route("/login", login_page, methods=["GET"]),
        Route("/login", login, methods=["POST"]),
        Route("/logout", logout, methods=["POST"]),
    ]
    found += [Route(path, _action(name, prepare), methods=["POST"])
              for path, name, prepare in ACTIONS]
    return found
