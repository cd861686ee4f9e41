"""mtq's API keys: made, listed and revoked by ``mtq keys``, checked and rate limited by
the gateway (``mtq serve``) on every request; an admin key (``admin`` true, ``mtq keys
create --admin``) also signs in to the web dashboard's actions. An admin key is a
gateway key of its tenant too: on the gateway it acts as that tenant, like any key.

A key's token reads ``mtq-<id>-<secret>``: ``id`` is 12 hex digits (not secret: it
names the key in ``mtq keys list`` and ``revoke``), ``secret`` is
``secrets.token_urlsafe(32)`` (256 random bits). Redis holds the key's record and the
SHA-256 of its secret, never the secret (:func:`mtq.broker.keys.api_key`); the token is
shown once, when it is made. A plain hash is enough for a secret of 256 random bits: a
slow password hash (bcrypt, scrypt) protects guessable passwords against a stolen
database, and nothing can guess these; a check costs one SHA-256 and one round trip
(HGETALL of the key's hash), and digests are compared with :func:`hmac.compare_digest`.

Rate limits (:func:`admit`): requests (``rpm``) and tokens (``tpm``) per minute, each a
GCRA (the algorithm of the tenants' limits of :doc:`scheduling`) whose burst is a
whole minute's budget, in one Lua script: a key may spend its minute at once, and then
one request every ``60 / rpm`` seconds (tokens likewise) as its budget comes back. It
works as a sliding window: no minute boundary at which every refused client comes back
at once (as a fixed window has), and two numbers of state per key instead of a log of
its requests. Over any 60 s a key is admitted at most twice its budget (a full minute's
burst, then what came back during that minute); over longer spans, its budget per
minute. A request of more tokens than a minute's budget is admitted once the key owes
nothing, so that it is not refused forever.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any

from redis.exceptions import NoScriptError

from mtq.broker.cluster import shared
from mtq.broker.connection import redis_errors
from mtq.broker.keys import API_KEYS, api_key, api_key_rate
from mtq.broker.scripts import script
from mtq.errors import InvalidApiKey, InvalidArgument
from mtq.validation import BANDS, check_tenant

__all__ = ["ApiKey", "admit", "any_keys", "authenticate", "create", "list_keys", "lookup",
           "revoke"]

#: a token: "mtq-", the key's id, "-", its secret (token_urlsafe may give '-' too)
_TOKEN = re.compile(r"mtq-([0-9a-f]{12})-([A-Za-z0-9_-]{32,128})")
_ID = re.compile(r"[0-9a-f]{12}")
#: the longest name a key may have (characters)
NAME_MAX = 200


@dataclass(frozen=True)
class ApiKey:
    """One API key's record (never its secret). ``priority``: the band its requests get
    (``interactive``, ``standard``, ``batch``; None: the gateway's default); ``rpm``,
    ``tpm``: its limits per minute (None: none); ``created``, ``revoked``: unix times
    (``revoked`` None while it is valid); ``admin``: it may act on the web dashboard
    (pause, resume, drain, scale, cancel, dead letters)."""

    id: str
    tenant: str
    priority: str | None
    rpm: int | None
    tpm: int | None
    name: str
    created: float
    revoked: float | None = None
    admin: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "tenant": self.tenant, "priority": self.priority,
                "rpm": self.rpm, "tpm": self.tpm, "name": self.name,
                "created": self.created, "revoked": self.revoked, "admin": self.admin}


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def _limit(value: object, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 10**12:
        raise InvalidArgument(f"{what} must be a whole number from 1 to 10**12 (leave it "
                              f"out for no limit), got {value!r}")
    return value


def _str(value: bytes | str) -> str:
    """Text of a reply: bytes (mtq's clients) or str (a client made with
    ``decode_responses=True``)."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def _fields(raw: dict[Any, Any]) -> dict[str, str]:
    return {_str(k): _str(v) for k, v in raw.items()}


def _text(raw: dict[str, str], field: str) -> str:
    return raw.get(field, "")


def _record(key_id: str, raw: dict[str, str]) -> ApiKey:
    def number(field: str) -> int | None:
        text = _text(raw, field)
        return int(text) if text else None

    revoked = _text(raw, "revoked")
    return ApiKey(id=key_id, tenant=_text(raw, "tenant"),
                  priority=_text(raw, "priority") or None, rpm=number("rpm"),
                  tpm=number("tpm"), name=_text(raw, "name"),
                  created=float(_text(raw, "created") or 0),
                  revoked=float(revoked) if revoked else None,
                  admin=_text(raw, "admin") == "1")


def create(client: Any, tenant: str, *, priority: str | None = None, rpm: int | None = None,
           tpm: int | None = None, name: str = "", admin: bool = False
           ) -> tuple[str, ApiKey]:
    """Make a key for ``tenant``; returns its token (shown once: only its digest is
    kept) and its record. ``admin``: the key may also act on the web dashboard.
    Raises InvalidName for a tenant name that is not allowed and InvalidArgument for a
    priority, limit, name or admin flag that is not."""
    check_tenant(tenant)
    if not isinstance(admin, bool):
        raise InvalidArgument(f"admin is True or False, got {admin!r}")
    if priority is not None and priority not in BANDS:
        raise InvalidArgument(f"unknown priority {priority!r}: use one of "
                              f"{', '.join(BANDS)}, or leave it out")
    rpm, tpm = _limit(rpm, "rpm"), _limit(tpm, "tpm")
    if not isinstance(name, str) or len(name) > NAME_MAX:
        raise InvalidArgument(f"a key's name is text of at most {NAME_MAX} characters")
    c = shared(client)
    secret = secrets.token_urlsafe(32)
    created = time.time()
    with redis_errors("while creating an API key"):
        while True:
            key_id = secrets.token_hex(6)
            if c.hsetnx(api_key(key_id), "digest", _digest(secret)):
                break  # a new id (48 random bits: taken ids are all but impossible)
        c.hset(api_key(key_id), mapping={
            "tenant": tenant, "priority": priority or "", "rpm": "" if rpm is None else rpm,
            "tpm": "" if tpm is None else tpm, "name": name, "created": repr(created),
            "admin": "1" if admin else ""})
        c.sadd(API_KEYS, key_id)
    record = ApiKey(key_id, tenant, priority, rpm, tpm, name, created, admin=admin)
    return f"mtq-{key_id}-{secret}", record


def list_keys(client: Any, tenant: str | None = None) -> list[ApiKey]:
    """Every key (revoked ones too), oldest first; only ``tenant``'s if given."""
    if tenant is not None:
        check_tenant(tenant)
    c = shared(client)
    with redis_errors("while listing API keys"):
        ids = sorted(_str(i) for i in c.smembers(API_KEYS))
        pipe = c.pipeline(transaction=False)  # keys of any slot, on a cluster
        for key_id in ids:
            pipe.hgetall(api_key(key_id))
        raws = pipe.execute() if ids else []
    keys = [_record(key_id, _fields(raw)) for key_id, raw in zip(ids, raws, strict=True)
            if raw]
    keys = [k for k in keys if tenant is None or k.tenant == tenant]
    return sorted(keys, key=lambda k: (k.created, k.id))


def revoke(client: Any, key_id: str) -> bool:
    """Revoke a key from now on (its record stays, marked, for ``mtq keys list``);
    False if no key has this id. Revoking a revoked key changes nothing."""
    if not isinstance(key_id, str) or not _ID.fullmatch(key_id):
        return False
    c = shared(client)
    with redis_errors("while revoking an API key"):
        if not c.exists(api_key(key_id)):
            return False
        c.hsetnx(api_key(key_id), "revoked", repr(time.time()))
        c.delete(api_key_rate(key_id))
    return True


def any_keys(client: Any) -> bool:
    """Whether any key that is not revoked exists (the gateway refuses to listen beyond
    loopback without one)."""
    return any(k.revoked is None for k in list_keys(client))


def lookup(client: Any, key_id: str) -> ApiKey | None:
    """The record of the key ``key_id`` (revoked or not), or None if there is none
    (one round trip; none for an id that cannot be one)."""
    if not isinstance(key_id, str) or not _ID.fullmatch(key_id):
        return None
    with redis_errors("while reading an API key"):
        raw = _fields(shared(client).hgetall(api_key(key_id)))
    if not raw.get("digest") or not raw.get("tenant"):
        return None
    return _record(key_id, raw)


def authenticate(client: Any, token: str | None) -> ApiKey:
    """The key ``token`` is (one round trip). Raises InvalidApiKey for a missing,
    malformed, unknown or revoked key, or a wrong secret; its message never holds the
    secret."""
    if not token:
        raise InvalidApiKey("missing")
    m = _TOKEN.fullmatch(token) if isinstance(token, str) else None
    if m is None:
        raise InvalidApiKey("malformed")
    key_id, secret = m.groups()
    with redis_errors("while checking an API key"):
        raw = _fields(shared(client).hgetall(api_key(key_id)))
    stored = raw.get("digest", "")
    # compared even when there is no key, so the time taken tells nothing
    if not hmac.compare_digest(_digest(secret).encode(), (stored or "-" * 64).encode()) \
            or not stored or not raw.get("tenant"):
        # (no tenant: a create that failed half way, whose token nobody was given)
        raise InvalidApiKey("unknown", key_id)
    record = _record(key_id, raw)
    if record.revoked is not None:
        raise InvalidApiKey("revoked", key_id)
    return record


def admit(client: Any, key: ApiKey, tokens: int) -> float:
    """Count one request of ``tokens`` tokens against ``key``'s limits: 0.0 if it is
    admitted (and counted), else the seconds until it would be (nothing counted). One
    round trip (a Lua script; none for a key without limits)."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise InvalidArgument(f"tokens must be a whole number, 0 or more, got {tokens!r}")
    if key.rpm is None and key.tpm is None:
        return 0.0
    admit_lua = script("admit")  # mtq/broker/lua/admit.lua
    c = shared(client)
    args = (api_key_rate(key.id), key.rpm or 0, key.tpm or 0, tokens)
    with redis_errors("while counting a request against its API key's limits"):
        try:
            wait = c.evalsha(admit_lua.sha, 1, *args)
        except NoScriptError:
            wait = c.eval(admit_lua.source, 1, *args)  # loads it too: evalsha works next time
    ms = float(wait)
    return ms / 1000.0 if ms > 0 else 0.0
