"""The rules a request to the web dashboard's actions must keep, each a check that
raises :class:`Refused` (its status and what to do) before anything is done: where it
comes from (``Origin``, else ``Referer``: the dashboard's own origin), its CSRF token,
where it may send the browser back to (``next``: a path of the dashboard, never
another site), and its body (a form or a JSON object of at most 256 KiB); and the
headers every answer carries (:class:`SecurityHeaders`)."""

from __future__ import annotations

import hmac
import json
import re
from urllib.parse import parse_qs, urlsplit

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mtq.dashboard.web.actions import Form
from mtq.errors import (
    BrokerError,
    ConfigError,
    InvalidArgument,
    InvalidName,
    MtqError,
    TaskNotFound,
)

#: the largest form (or JSON body) an action takes
MAX_BODY_BYTES = 256 * 1024
ORIGIN = re.compile(r"https?://[A-Za-z0-9.\-\[\]:]+")


class Refused(MtqError):
    """A request refused before anything was done: its status and what to do."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def root(request: Request) -> str:
    return str(request.scope.get("root_path", "")).rstrip("/")


def origin_of(request: Request) -> str:
    public = getattr(request.app.state, "public_origin", None)
    return public or f"{request.url.scheme}://{request.url.netloc}".lower()


def secure(request: Request) -> bool:
    return origin_of(request).startswith("https://") or request.url.scheme == "https"


def check_origin(request: Request) -> None:
    """A browser's POST names the page it comes from (``Origin``, else ``Referer``):
    it must be the dashboard's own origin. Neither header: the CSRF token decides."""
    sent = request.headers.get("origin")
    if sent is None:
        referer = request.headers.get("referer")
        if not referer:
            return
        parts = urlsplit(referer)
        sent = f"{parts.scheme}://{parts.netloc}"
    if sent.lower() != origin_of(request):
        raise Refused(403, f"this request came from another site ({sent}), not from the "
                      f"dashboard's own pages ({origin_of(request)}): nothing was done. Use "
                      "the dashboard's own forms. Behind a proxy that changes the Host "
                      "header, give the dashboard its public origin (--origin https://... "
                      "of mtq dashboard --web or mtq serve)")


def next_path(request: Request, value: str | None) -> str:
    """Where to send the browser back: a path of the dashboard (with or without its
    mount point); no other site, ``//host`` or scheme."""
    base = root(request)
    if value is None or value == "":
        return base + "/"
    if not value.startswith("/") or value.startswith("//") or "\\" in value or \
            any(c.isspace() or not c.isprintable() for c in value) or len(value) > 2000 or \
            urlsplit(value).scheme or urlsplit(value).netloc:
        raise Refused(400, f"next must be a path of this dashboard (such as /queues/q), got "
                      f"{value[:100]!r}: nothing was done")
    if base and not (value == base or value.startswith(base + "/")
                     or value.startswith(base + "?")):
        value = base + value
    return value


def one(form: Form, name: str) -> str | None:
    values = form.get(name) or []
    return values[0] if len(values) == 1 else None


async def read_form(request: Request) -> Form:
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


def check_csrf(form: Form, expected: str | None, what: str) -> None:
    sent = one(form, "csrf") or ""
    if not expected or not sent or not hmac.compare_digest(sent.encode(), expected.encode()):
        raise Refused(403, f"{what} did not carry this session's CSRF token (a form from "
                      "another site, or a page older than your sign-in): nothing was done. "
                      "Reload the dashboard's page and send it again")


def refusal_of(exc: MtqError) -> Refused:
    if isinstance(exc, (InvalidName, InvalidArgument, ConfigError)):
        return Refused(400, f"{exc}: nothing was done")
    if isinstance(exc, TaskNotFound):
        return Refused(404, str(exc))
    if isinstance(exc, BrokerError):
        return Refused(503, f"{exc}: nothing was done, try again once Redis is back")
    return Refused(500, f"{type(exc).__name__}: {exc}")


#: what every answer of the dashboard carries: scripts only from the dashboard itself
#: (no inline script: a value that escaped the templates still could not run), no
#: framing by another site (an admin's buttons cannot be overlaid), no sniffing of
#: a preview's content type
SECURITY_HEADERS = (
    (b"content-security-policy",
     b"default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
     b"img-src 'self' data:; object-src 'none'; base-uri 'none'; form-action 'self'; "
     b"frame-ancestors 'none'"),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
)


class SecurityHeaders:
    """ASGI middleware adding :data:`SECURITY_HEADERS` to every HTTP answer (streams
    included: it only touches the start of the answer)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), *SECURITY_HEADERS]
            await send(message)

        await self.app(scope, receive, send_with_headers)

