"""Who is behind a request to the web dashboard: an admin key given as ``Authorization:
Bearer`` (scripts), or a signed-in session (browsers, whatever other ``Authorization``
a proxy in front has them send), kept in Redis.

A session is made when an admin key signs in (:func:`start`). Its id, 256 random bits,
is the only thing its cookie holds; Redis keeps, under the SHA-256 of that id (so that
whoever reads the database learns no cookie that works), the admin key's id, the
session's CSRF token and when it began, for :data:`SESSION_TTL_S`. Every request that
comes with the cookie reads the session and then the key's record (two round trips,
once per request: :func:`caller` keeps the answer on the request): a key revoked
since, or one that is no admin key any more, ends the session there and then.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from mtq.broker.cluster import shared
from mtq.broker.connection import redis_errors
from mtq.broker.keys import dashboard_session
from mtq.client import apikeys
from mtq.client.apikeys import ApiKey
from mtq.errors import InvalidApiKey

#: the cookie that holds a session's id
SESSION_COOKIE = "mtq_session"
#: how long a session lasts from its sign-in (seconds): then the admin signs in again
SESSION_TTL_S = 12 * 3600
#: what a session id, a CSRF token or a login token reads (secrets.token_urlsafe(32))
TOKEN = re.compile(r"[A-Za-z0-9_-]{43}")
_SIGN_IN = "sign in with an admin key ('mtq keys create --tenant T --admin' makes one)"


@dataclass(frozen=True)
class Session:
    """A signed-in browser: ``id`` its cookie's value, ``key_id`` the admin key it
    belongs to, ``csrf`` the token its forms carry."""

    id: str
    key_id: str
    csrf: str


@dataclass(frozen=True)
class Caller:
    """Who sent a request: ``key`` the admin key (None: nobody who may act, and
    ``refusal`` says why and what to do), ``session`` the browser session it came
    with (None for a Bearer key or nobody), ``bearer``: it came with an
    ``Authorization`` header (its answers are JSON, and no CSRF token is asked)."""

    key: ApiKey | None
    session: Session | None = None
    bearer: bool = False
    refusal: str = ""


def _digest(session_id: str) -> str:
    return hashlib.sha256(session_id.encode()).hexdigest()


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def start(client: Any, key: ApiKey) -> Session:
    """A new session of the admin key ``key`` (one round trip)."""
    session = Session(secrets.token_urlsafe(32), key.id, secrets.token_urlsafe(32))
    name = dashboard_session(_digest(session.id))
    with redis_errors("while starting a dashboard session"):
        pipe = shared(client).pipeline(transaction=True)
        pipe.hset(name, mapping={"key": key.id, "csrf": session.csrf,
                                 "created": repr(time.time())})
        pipe.expire(name, SESSION_TTL_S)
        pipe.execute()
    return session


def load(client: Any, session_id: str | None) -> Session | None:
    """The session whose cookie holds ``session_id``, or None (none, ended, expired)."""
    if not session_id or not TOKEN.fullmatch(session_id):
        return None
    with redis_errors("while reading a dashboard session"):
        raw = shared(client).hgetall(dashboard_session(_digest(session_id)))
    fields = {_text(k): _text(v) for k, v in raw.items()}
    if not fields.get("key") or not fields.get("csrf"):
        return None
    return Session(session_id, fields["key"], fields["csrf"])


def end(client: Any, session_id: str) -> None:
    """End a session (signing out; a revoked key's session)."""
    if not TOKEN.fullmatch(session_id):
        return
    with redis_errors("while ending a dashboard session"):
        shared(client).delete(dashboard_session(_digest(session_id)))


def client_of(request: Request) -> Any:
    """The dashboard's Redis client (``app.state.client``)."""
    return request.app.state.client


def is_bearer(request: Request) -> bool:
    """Whether ``request`` is a script's: ``Authorization: Bearer ...``. Another scheme
    (``Basic``: a proxy's own authentication, which the browser sends with every
    request, cross-site forms included) is no key of ours: the request is a browser's,
    and its session and CSRF token decide."""
    scheme = request.headers.get("authorization", "").strip().partition(" ")[0]
    return scheme.lower() == "bearer"


def _bearer(client: Any, header: str) -> Caller:
    token = header.strip().partition(" ")[2]
    if not token.strip():
        return Caller(None, bearer=True, refusal="send an admin key as 'Authorization: "
                      "Bearer mtq-...'; " + _SIGN_IN)
    try:
        key = apikeys.authenticate(client, token.strip())
    except InvalidApiKey as exc:
        return Caller(None, bearer=True, refusal=f"{exc} (the dashboard's actions need an "
                      "admin key: 'mtq keys create --tenant T --admin')")
    if not key.admin:
        return Caller(None, bearer=True, refusal=f"API key {key.id} is not an admin key: "
                      "the dashboard's actions need one ('mtq keys create --tenant T "
                      "--admin' makes one)")
    return Caller(key, bearer=True)


def _resolve(request: Request) -> Caller:
    client = client_of(request)
    if is_bearer(request):
        return _bearer(client, request.headers["authorization"])
    session_id = request.cookies.get(SESSION_COOKIE)
    if not session_id:
        return Caller(None, refusal="you are not signed in: " + _SIGN_IN)
    session = load(client, session_id)
    if session is None:
        return Caller(None, refusal="your session has ended (signed out, or "
                      f"{SESSION_TTL_S // 3600} h passed): " + _SIGN_IN)
    key = apikeys.lookup(client, session.key_id)
    if key is None or key.revoked is not None or not key.admin:
        end(client, session.id)
        return Caller(None, refusal=f"the admin key of your session ({session.key_id}) "
                      "was revoked, and the session with it: " + _SIGN_IN)
    return Caller(key, session)


def caller(request: Request) -> Caller:
    """Who sent ``request`` (read once per request, then kept on it). Raises
    BrokerError while Redis cannot be reached."""
    known = getattr(request.state, "mtq_caller", None)
    if isinstance(known, Caller):
        return known
    found = _resolve(request)
    request.state.mtq_caller = found
    return found
