"""mtq.client.apikeys without Redis: what is refused before Redis is asked, the messages,
and what importing it loads. (The rest, on a real redis-server, is in
tests/integration/test_gateway_keys.py.)"""

from __future__ import annotations

import subprocess
import sys

import pytest

import mtq
from mtq.client import apikeys as keys
from mtq.errors import InvalidApiKey, InvalidArgument, InvalidName

#: a client that must not be used: each case here is refused before Redis is asked
NO_REDIS = None
SECRET = "Abc-_" * 8 + "xyz"  # 43 characters, as token_urlsafe(32) gives


@pytest.mark.parametrize("token, reason", [
    (None, "missing"),
    ("", "missing"),
    ("sk-" + SECRET, "malformed"),
    ("mtq-ABCDEF012345-" + SECRET, "malformed"),   # the id is lower-case hex
    ("mtq-0123456789a-" + SECRET, "malformed"),    # 11 digits
    ("mtq-0123456789ab-" + SECRET[:20], "malformed"),
    ("mtq-0123456789ab-" + SECRET + "!", "malformed"),
    ("Bearer mtq-0123456789ab-" + SECRET, "malformed"),
    (12345, "malformed"),
])
def test_tokens_refused_before_redis(token, reason):
    with pytest.raises(InvalidApiKey) as info:
        keys.authenticate(NO_REDIS, token)
    assert info.value.reason == reason
    assert SECRET not in str(info.value) and SECRET[:20] not in str(info.value)
    assert "mtq keys create" in str(info.value)


def test_messages_say_what_to_do_and_name_only_the_id():
    for reason in ("missing", "malformed", "unknown", "revoked", "other"):
        text = str(InvalidApiKey(reason, "0123456789ab"))
        assert "mtq keys create" in text, reason
    assert "0123456789ab was revoked" in str(InvalidApiKey("revoked", "0123456789ab"))
    assert "Authorization: Bearer" in str(InvalidApiKey("missing"))
    assert issubclass(InvalidApiKey, mtq.MtqError) and mtq.InvalidApiKey is InvalidApiKey


@pytest.mark.parametrize("kwargs, error", [
    ({"tenant": "two words"}, InvalidName),
    ({"tenant": ""}, InvalidName),
    ({"tenant": "acme", "priority": "high"}, InvalidArgument),
    ({"tenant": "acme", "rpm": 0}, InvalidArgument),
    ({"tenant": "acme", "tpm": 2.5}, InvalidArgument),
    ({"tenant": "acme", "rpm": False}, InvalidArgument),
    ({"tenant": "acme", "rpm": 10**13}, InvalidArgument),
    ({"tenant": "acme", "name": 7}, InvalidArgument),
    ({"tenant": "acme", "name": "n" * (keys.NAME_MAX + 1)}, InvalidArgument),
    ({"tenant": "acme", "admin": "yes"}, InvalidArgument),
    ({"tenant": "acme", "admin": 1}, InvalidArgument),
])
def test_create_refuses_bad_arguments_before_redis(kwargs, error):
    tenant = kwargs.pop("tenant")
    with pytest.raises(error):
        keys.create(NO_REDIS, tenant, **kwargs)


def test_admit_without_limits_needs_no_round_trip():
    key = keys.ApiKey("0123456789ab", "acme", None, None, None, "", 1.0)
    assert keys.admit(NO_REDIS, key, 10**9) == 0.0
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(InvalidArgument):
            keys.admit(NO_REDIS, key, bad)  # type: ignore[arg-type]


def test_revoke_of_an_id_that_cannot_be_one_is_false_before_redis():
    assert keys.revoke(NO_REDIS, "nope") is False
    assert keys.revoke(NO_REDIS, "0123456789AB") is False


def test_record_as_dict_has_no_secret():
    key = keys.ApiKey("0123456789ab", "acme", "batch", 5, None, "n", 1.0)
    assert key.as_dict() == {"id": "0123456789ab", "tenant": "acme", "priority": "batch",
                             "rpm": 5, "tpm": None, "name": "n", "created": 1.0,
                             "revoked": None, "admin": False}
    assert keys.ApiKey("0123456789ab", "acme", None, None, None, "", 1.0,
                       admin=True).as_dict()["admin"] is True


def test_importing_it_loads_no_web_server_and_no_torch():
    code = ("import sys, mtq.client.apikeys; "
            "print(sorted(m for m in ('torch', 'starlette', 'uvicorn', 'rich') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.strip() == "[]", out
