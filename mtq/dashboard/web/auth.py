"""Who may act on the web dashboard: reading needs nothing, every action needs an admin
key, and forms are protected against cross-site requests (see docs/dashboard.md,
"Access and actions").

Interface used by the pages (:mod:`mtq.dashboard.web.app`):

* :func:`admin` -- the admin key behind a request (its session cookie, or an
  ``Authorization: Bearer`` header), or None. The first call on a request reads Redis
  (two round trips: the session, then its key), later ones reuse the answer;
* :func:`csrf_token` -- the value a form posted by that admin carries in its ``csrf``
  field. Signed out, it is the pre-session token of the sign-in form (the
  ``mtq_login`` cookie that ``GET /login`` sets), or "" before the browser has one;
* :func:`flash` (and :func:`flash_kind`, ``ok`` or ``warning``) -- the message an
  action left for the page it sent the browser back to (None: none). The action
  redirects (303) to its ``next`` with ``?flash=<nonce>`` and sets the short-lived
  cookie ``mtq_flash`` holding that nonce and the message: the page shows it only with
  its own nonce, so a link cannot make a page show a text of its choosing, and it is
  not shown again on the next page;
* :func:`configure` -- ``configure(app, origin="https://ops.example.com")``: the
  dashboard's public origin when it is served behind a proxy that changes the Host
  header (``create_dashboard(origin=...)``, ``mtq dashboard --web --origin``). It is
  kept in ``app.state.public_origin``; without it, the request's own scheme and Host
  are the dashboard's origin;
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
import re
import secrets
from html import escape
from typing import Any
from urllib.parse import parse_qs, parse_qsl, urlencode, urlsplit

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Route

from mtq.client import apikeys
from mtq.dashboard.web import sessions
from mtq.dashboard.web.actions import ACTIONS, Form, Prepare
from mtq.dashboard.web.sessions import SESSION_COOKIE, SESSION_TTL_S, TOKEN, caller
from mtq.errors import (
    BrokerError,
    ConfigError,
    InvalidApiKey,
    InvalidArgument,
    InvalidName,
    MtqError,
    TaskNotFound,
)

log = logging.getLogger("mtq.dashboard.web")

#: the pre-session token of the sign-in form (login CSRF: double submit)
LOGIN_COOKIE = "mtq_login"
LOGIN_TTL_S = 3600
#: the message an action leaves for the page it sends the browser back to
FLASH_COOKIE = "mtq_flash"
FLASH_TTL_S = 60
#: the largest form (or JSON body) an action takes
MAX_BODY_BYTES = 256 * 1024
_ORIGIN = re.compile(r"https?://[A-Za-z0-9.\-\[\]:]+")


class Refused(Exception):
    """A request refused before anything was done: its status and what to do."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


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
    form's pre-session token ("" before ``GET /login`` has set one)."""
    try:
        found = caller(request)
    except MtqError:
        return ""
    if found.session is not None:
        return found.session.csrf
    token = request.cookies.get(LOGIN_COOKIE, "")
    return token if TOKEN.fullmatch(token) else ""


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
    """Set the dashboard's public origin (``https://host[:port]``, as browsers send
    ``Origin``) for a dashboard behind a proxy that changes the Host header. Raises
    ConfigError for anything else."""
    if origin is not None:
        if not isinstance(origin, str) or not _ORIGIN.fullmatch(origin.rstrip("/")):
            raise ConfigError(f"origin {origin!r}: give the scheme and host the browser "
                              "sees, e.g. https://ops.example.com or http://10.0.0.5:8080 "
                              "(no path)")
        origin = origin.rstrip("/").lower()
    app.state.public_origin = origin


# -- the rules ---------------------------------------------------------------------------
def _root(request: Request) -> str:
    return str(request.scope.get("root_path", "")).rstrip("/")


def _origin(request: Request) -> str:
    public = getattr(request.app.state, "public_origin", None)
    return public or f"{request.url.scheme}://{request.url.netloc}".lower()


def _secure(request: Request) -> bool:
    return _origin(request).startswith("https://") or request.url.scheme == "https"


def _check_origin(request: Request) -> None:
    """A browser's POST names the page it comes from (``Origin``, else ``Referer``):
    it must be the dashboard's own origin. Neither header: the CSRF token decides."""
    sent = request.headers.get("origin")
    if sent is None:
        referer = request.headers.get("referer")
        if not referer:
            return
        parts = urlsplit(referer)
        sent = f"{parts.scheme}://{parts.netloc}"
    if sent.lower() != _origin(request):
        raise Refused(403, f"this request came from another site ({sent}), not from the "
                      f"dashboard's own pages ({_origin(request)}): nothing was done. Use "
                      "the dashboard's own forms. Behind a proxy that changes the Host "
                      "header, give the dashboard its public origin (mtq dashboard --web "
                      "--origin https://...)")


def _next(request: Request, value: str | None) -> str:
    """Where to send the browser back: a path of the dashboard (with or without its
    mount point); no other site, ``//host`` or scheme."""
    root = _root(request)
    if value is None or value == "":
        return root + "/"
    if not value.startswith("/") or value.startswith("//") or "\\" in value or \
            any(c.isspace() or not c.isprintable() for c in value) or len(value) > 2000 or \
            urlsplit(value).scheme or urlsplit(value).netloc:
        raise Refused(400, f"next must be a path of this dashboard (such as /queues/q), got "
                      f"{value[:100]!r}: nothing was done")
    if root and not (value == root or value.startswith(root + "/")
                     or value.startswith(root + "?")):
        value = root + value
    return value


def _one(form: Form, name: str) -> str | None:
    values = form.get(name) or []
    return values[0] if len(values) == 1 else None


async def _form(request: Request) -> Form:
    """The request's fields: a form (application/x-www-form-urlencoded), or, from a
    script, a JSON object (values as text; a list for ``id``)."""
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise Refused(413, f"the request is over {MAX_BODY_BYTES // 1024} KiB: send "
                          "fewer ids at once")
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    try:
        text = body.decode("utf-8")
        if kind == "application/json":
            raw = json.loads(text or "{}")
            if not isinstance(raw, dict):
                raise ValueError("not an object")
            return {str(k): [str(x) for x in (v if isinstance(v, list) else [v])]
                    for k, v in raw.items()}
        if kind not in ("", "application/x-www-form-urlencoded"):
            raise ValueError(f"content type {kind}")
        return parse_qs(text, keep_blank_values=True, max_num_fields=2000)
    except ValueError as exc:
        raise Refused(400, f"the request's body cannot be read ({exc}): send a form "
                      "(application/x-www-form-urlencoded) or a JSON object") from None


def _check_csrf(form: Form, expected: str | None, what: str) -> None:
    sent = _one(form, "csrf") or ""
    if not expected or not sent or not hmac.compare_digest(sent.encode(), expected.encode()):
        raise Refused(403, f"{what} did not carry this session's CSRF token (a form from "
                      "another site, or a page older than your sign-in): nothing was done. "
                      "Reload the dashboard's page and send it again")


# -- answers -----------------------------------------------------------------------------
_STYLE = ("body{font:15px system-ui,sans-serif;max-width:40em;margin:3em auto;padding:0 1em}"
          "p.msg{padding:.6em .8em;border-left:4px solid #c33;background:#fbeeee}"
          "input[type=password]{width:100%;padding:.4em;margin:.4em 0}")


def _page(request: Request, status: int, title: str, message: str, *,
          form: bool = False, nxt: str | None = None) -> HTMLResponse:
    root, back = _root(request), escape(nxt or _root(request) + "/")
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
            f'<form method="post" action="{escape(root)}/login">'
            f'<input type="hidden" name="csrf" value="{escape(token)}">'
            f'<input type="hidden" name="next" value="{back}">'
            '<label>Admin key <input type="password" name="key" autocomplete="off" '
            'placeholder="mtq-..." required></label> '
            '<button type="submit">Sign in</button></form>'
            "<p>An admin key is made with <code>mtq keys create --tenant T --admin</code>. "
            "The dashboard is read-only without one.</p>")
    elif status == 401:
        login = escape(f"{root}/login?" + urlencode({"next": nxt or root + "/"}))
        parts.append(f'<p><a href="{login}">Sign in</a> with an admin key.</p>')
    parts.append(f'<p><a href="{back}">Back to the dashboard</a></p></body></html>')
    resp = HTMLResponse("".join(parts), status)
    if form:
        resp.set_cookie(LOGIN_COOKIE, token, max_age=LOGIN_TTL_S, path=root or "/",
                        httponly=True, samesite="strict", secure=_secure(request))
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
                    max_age=FLASH_TTL_S, path=_root(request) or "/", httponly=True,
                    samesite="strict", secure=_secure(request))
    return resp


def _mtq_refusal(exc: MtqError) -> Refused:
    if isinstance(exc, (InvalidName, InvalidArgument, ConfigError)):
        return Refused(400, f"{exc}: nothing was done")
    if isinstance(exc, TaskNotFound):
        return Refused(404, str(exc))
    if isinstance(exc, BrokerError):
        return Refused(503, f"{exc}: nothing was done, try again once Redis is back")
    return Refused(500, f"{type(exc).__name__}: {exc}")


# -- the routes --------------------------------------------------------------------------
async def login_page(request: Request) -> Response:
    """``GET /login``: the sign-in form (it sets the pre-session token)."""
    try:
        nxt = _next(request, request.query_params.get("next"))
    except Refused:
        nxt = _root(request) + "/"
    return _page(request, 200, "Sign in", "", form=True, nxt=nxt)


async def login(request: Request) -> Response:
    """``POST /login``: field ``key``, an admin key's token; makes a session."""
    if "authorization" in request.headers:
        return JSONResponse({"ok": False, "error": "scripts need no session: send the "
                             "admin key as 'Authorization: Bearer' with each action"}, 400)
    nxt: str | None = None
    try:
        _check_origin(request)
        form = await _form(request)
        nxt = _next(request, _one(form, "next"))
        _check_csrf(form, request.cookies.get(LOGIN_COOKIE), "this sign-in form")
        client = sessions.client_of(request)
        key = await run_in_threadpool(apikeys.authenticate, client, _one(form, "key"))
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
        return _refusal(request, _mtq_refusal(exc), False, nxt)
    log.info("dashboard sign-in: admin key %s", key.id)
    resp = _back(request, nxt, "ok",
                 f"signed in with admin key {key.id} ({key.name or key.tenant})")
    resp.set_cookie(SESSION_COOKIE, session.id, max_age=SESSION_TTL_S,
                    path=_root(request) or "/", httponly=True, samesite="strict",
                    secure=_secure(request))
    resp.delete_cookie(LOGIN_COOKIE, path=_root(request) or "/")
    return resp


async def logout(request: Request) -> Response:
    """``POST /logout``: ends the browser's session."""
    nxt: str | None = None
    try:
        if "authorization" in request.headers:
            raise Refused(400, "a Bearer key has no session to end (revoke the key: "
                          "'mtq keys revoke ID')")
        _check_origin(request)
        form = await _form(request)
        nxt = _next(request, _one(form, "next"))
        found = await run_in_threadpool(caller, request)
        if found.session is not None:
            _check_csrf(form, found.session.csrf, "this sign-out")
            await run_in_threadpool(sessions.end, sessions.client_of(request),
                                    found.session.id)
            log.info("dashboard sign-out: admin key %s", found.session.key_id)
    except Refused as exc:
        return _refusal(request, exc, "authorization" in request.headers, nxt)
    except MtqError as exc:
        return _refusal(request, _mtq_refusal(exc), False, nxt)
    resp = _back(request, nxt, "ok", "signed out: the dashboard is read-only")
    resp.delete_cookie(SESSION_COOKIE, path=_root(request) or "/")
    return resp


def _action(name: str, prepare: Prepare) -> Any:
    async def endpoint(request: Request) -> Response:
        bearer = "authorization" in request.headers
        nxt: str | None = None
        try:
            found = await run_in_threadpool(caller, request)
            if not bearer:
                _check_origin(request)
            form = await _form(request)
            nxt = _next(request, _one(form, "next"))
            if found.key is None:
                raise Refused(401, found.refusal)
            if not bearer:
                _check_csrf(form, found.session.csrf if found.session else None,
                            "this form")
            act = prepare(request.path_params, form)   # every input checked: nothing sent yet
            done = await run_in_threadpool(act, sessions.client_of(request))
        except Refused as exc:
            log.info("dashboard %s refused (%d): %s", name, exc.status, exc)
            return _refusal(request, exc, bearer, nxt)
        except MtqError as exc:
            refused = _mtq_refusal(exc)
            log.info("dashboard %s refused (%d): %s", name, refused.status, refused)
            return _refusal(request, refused, bearer, nxt)
        log.info("dashboard %s by admin key %s (%s): %s", name, found.key.id,
                 "bearer" if bearer else "session", done.message)
        if bearer:
            return JSONResponse({"ok": done.status < 400, "action": name,
                                 "message": done.message, **done.data}, done.status)
        return _back(request, nxt or _root(request) + "/",
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
