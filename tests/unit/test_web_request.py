"""mtq.contrib.web without a server: a request's tenant name, priority and deadline
headers, and how they fill the options of a submit."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from mtq.contrib.web import (
    BadHeader,
    fill_options,
    header_deadline,
    header_priority,
    priority_from,
    retry_after,
    tenant_name,
)
from mtq.validation import check_tenant


def test_a_user_is_a_valid_tenant_name_as_it_is_or_hashed() -> None:
    assert tenant_name("ann") == "ann"
    assert tenant_name(42) == "42"
    assert tenant_name("ann@example.com") == "ann@example.com"
    assert tenant_name(None) is None and tenant_name("") is None
    for bad in ("ann smith", "_ann", "u" * 65, "émile", "a/b", "\udcff"):
        name = tenant_name(bad)
        assert name is not None and check_tenant(name) == name, bad
        assert name.startswith("sha1-") and len(name) == 45
        assert tenant_name(bad) == name  # stable: the same user, the same tenant
    digest = hashlib.sha1(b"ann smith", usedforsecurity=False).hexdigest()
    assert tenant_name("ann smith") == f"sha1-{digest}"
    assert tenant_name("ann smith") != tenant_name("ann  smith")


def test_the_priority_header() -> None:
    assert header_priority(None) is None and header_priority("  ") is None
    assert header_priority("batch") == "batch"
    assert header_priority(" Standard ") == "standard"
    assert priority_from(None) == "interactive" and priority_from("batch") == "batch"
    for bad in ("urgent", "i", "high", "batch,interactive"):
        with pytest.raises(BadHeader) as err:
            header_priority(bad)
        assert err.value.code == "bad_priority"
        assert "interactive, standard, batch" in str(err.value), str(err.value)


def test_the_deadline_header() -> None:
    assert header_deadline(None) is None and header_deadline("") is None
    assert header_deadline("30") == 30.0 and header_deadline(" 2.5 ") == 2.5
    for bad in ("soon", "0", "-1", "nan", "inf", "1e10", "30s"):
        with pytest.raises(BadHeader) as err:
            header_deadline(bad)
        assert err.value.code == "bad_deadline", bad


def test_the_request_fills_what_the_caller_did_not_give() -> None:
    def fill(options: dict[str, Any], deadline: str | None = None) -> dict[str, Any]:
        return fill_options(options, "req", lambda r: f"t-{r}", lambda r: "batch", deadline)

    assert fill({}) == {"tenant": "t-req", "priority": "batch"}
    # given ones win, None included (no tenant, the standard band)
    assert fill({"tenant": None, "priority": None}) == {"tenant": None, "priority": None}
    assert fill({"tenant": "acme", "priority": "interactive", "key": "k"}) == {
        "tenant": "acme", "priority": "interactive", "key": "k"}
    # the header's deadline; with a ttl, the sooner of the two is the deadline
    assert fill({}, "30")["deadline"] == 30.0
    assert fill({"ttl": None}, "30") == {"tenant": "t-req", "priority": "batch",
                                         "deadline": 30.0}
    assert fill({"ttl": 10}, "30") == {"tenant": "t-req", "priority": "batch",
                                       "deadline": 10}
    assert fill({"ttl": 60.0}, "30")["deadline"] == 30.0
    assert fill({"deadline": 5}, "30")["deadline"] == 5  # a given deadline wins
    assert "deadline" not in fill({"ttl": 10})
    with pytest.raises(BadHeader):
        fill({}, "never")


def test_retry_after_is_whole_seconds_rounded_up_at_least_one() -> None:
    assert [retry_after(s) for s in (0, 0.001, 1, 1.2, 59.9, 60)] == [
        "1", "1", "1", "2", "60", "60"]


def test_flask_s_default_tenant_is_g_user_in_the_shapes_apps_keep_it() -> None:
    flask = pytest.importorskip("flask")
    from types import SimpleNamespace

    from mtq.contrib.flask import request_priority, user_tenant

    app = flask.Flask(__name__)
    for user, tenant in [(None, None), ("ann", "ann"), (7, "7"),
                         (SimpleNamespace(id=12), "12"), ({"id": "bob"}, "bob"),
                         ({"name": "no id"}, None), ("ann smith", tenant_name("ann smith"))]:
        with app.test_request_context("/"):
            flask.g.user = user
            assert user_tenant(flask.request) == tenant, user
    with app.test_request_context("/", headers={"X-Mtq-Priority": "batch"}):
        assert user_tenant(flask.request) is None  # no g.user at all
        assert request_priority(flask.request) == "batch"


def test_starlette_s_default_tenant_is_the_authenticated_user() -> None:
    pytest.importorskip("starlette")
    from starlette.authentication import SimpleUser, UnauthenticatedUser
    from starlette.requests import Request

    from mtq.contrib.asgi import request_priority, user_tenant

    def request(user: Any, headers: list[tuple[bytes, bytes]] | None = None) -> Request:
        scope = {"type": "http", "headers": headers or [], "user": user}
        return Request(scope)

    assert user_tenant(request(SimpleUser("ann"))) == "ann"
    assert user_tenant(request(SimpleUser("Ann Smith"))) == tenant_name("Ann Smith")
    assert user_tenant(request(UnauthenticatedUser())) is None
    assert user_tenant(request(None)) is None
    assert request_priority(request(None)) == "interactive"
    assert request_priority(request(None, [(b"x-mtq-priority", b"standard")])) == "standard"
