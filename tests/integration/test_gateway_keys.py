"""The API keys (mtq.client.apikeys) and ``mtq keys``, on a real redis-server."""

from __future__ import annotations

import hashlib
import json
import time
import uuid

import pytest
import redis
from click.testing import CliRunner

import mtq
from mtq.broker.keys import API_KEYS, api_key, api_key_rate
from mtq.cli.main import cli
from mtq.client import apikeys as keys
from mtq.errors import InvalidApiKey, InvalidArgument, InvalidName
from tests.support.servers import RedisServer
from tests.support.waits import wait_for


@pytest.fixture
def tenant() -> str:
    """A tenant of this test's own (tests share one server, and list every key)."""
    return "k-" + uuid.uuid4().hex[:10]


@pytest.fixture(autouse=True)
def isolated_env(monkeypatch, tmp_path):
    """No test here may reach the user's embedded server or an outside MTQ_REDIS_URL."""
    monkeypatch.setenv("MTQ_HOME", str(tmp_path / "mtq-home"))
    monkeypatch.delenv("MTQ_REDIS_URL", raising=False)


def _secret(token: str) -> str:
    return token.split("-", 2)[2]


# -- the library -------------------------------------------------------------------
def test_create_list_revoke(client, tenant):
    token, key = keys.create(client, tenant, priority="interactive", rpm=60, tpm=1000,
                             name="ci bot")
    assert token.startswith(f"mtq-{key.id}-") and len(_secret(token)) == 43
    assert (key.tenant, key.priority, key.rpm, key.tpm, key.name, key.revoked) == (
        tenant, "interactive", 60, 1000, "ci bot", None)
    assert abs(key.created - time.time()) < 60
    plain_token, plain = keys.create(client, tenant)
    assert (plain.priority, plain.rpm, plain.tpm, plain.name) == (None, None, None, "")
    _, other = keys.create(client, tenant + "x")

    assert keys.list_keys(client, tenant) == [key, plain]
    everyone = keys.list_keys(client)
    assert {key, plain, other} <= set(everyone)

    assert keys.revoke(client, key.id) is True
    assert keys.revoke(client, key.id) is True  # again: nothing changes
    assert keys.revoke(client, "0123456789ab") is False
    assert keys.revoke(client, "not an id") is False
    listed = {k.id: k for k in keys.list_keys(client, tenant)}
    assert listed[key.id].revoked is not None and listed[plain.id].revoked is None
    assert keys.authenticate(client, plain_token) == plain


def test_authenticate(client, tenant):
    token, key = keys.create(client, tenant, priority="batch", tpm=500)
    assert keys.authenticate(client, token) == key

    wrong = token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB")
    unknown_id = "mtq-0123456789ab-" + _secret(token)
    cases = {
        "missing": [None, ""],
        "malformed": ["sk-" + _secret(token), "mtq-xyz-" + _secret(token), token + " ",
                      f"mtq-{key.id}-short", "Bearer " + token],
        "unknown": [wrong, unknown_id],
    }
    half_made = "mtq-00000000beef-" + _secret(token)  # a create that failed half way
    client.hset(api_key("00000000beef"), "digest", hashlib.sha256(
        _secret(token).encode()).hexdigest())
    cases["unknown"].append(half_made)
    for reason, tokens in cases.items():
        for bad in tokens:
            with pytest.raises(InvalidApiKey) as info:
                keys.authenticate(client, bad)
            assert info.value.reason == reason, bad
            assert _secret(token) not in str(info.value)
            assert "mtq keys create" in str(info.value)  # what to do
    client.delete(api_key("00000000beef"))
    assert keys.revoke(client, key.id)
    with pytest.raises(InvalidApiKey) as info:
        keys.authenticate(client, token)
    assert info.value.reason == "revoked" and info.value.key_id == key.id
    assert key.id in str(info.value) and _secret(token) not in str(info.value)
    assert isinstance(info.value, mtq.MtqError) and mtq.InvalidApiKey is InvalidApiKey


def test_bad_arguments_are_refused_and_write_nothing(client, tenant):
    before = client.scard(API_KEYS)
    for kwargs in ({"priority": "urgent"}, {"rpm": 0}, {"tpm": -5}, {"rpm": 1.5},
                   {"rpm": True}, {"name": "x" * 201}):
        with pytest.raises(InvalidArgument):
            keys.create(client, tenant, **kwargs)
    with pytest.raises(InvalidName):
        keys.create(client, "no spaces allowed")
    assert client.scard(API_KEYS) == before
    assert keys.list_keys(client, tenant) == []


def test_any_keys_ignores_revoked_ones(tmp_path, tenant):
    # a server of its own: the shared one holds other tests' keys, which this must not revoke
    server = RedisServer(tmp_path)
    server.start()
    own = redis.Redis.from_url(server.url)
    try:
        assert keys.any_keys(own) is False
        _, key = keys.create(own, tenant)
        assert keys.any_keys(own) is True
        keys.revoke(own, key.id)
        assert keys.any_keys(own) is False
    finally:
        own.close()
        server.stop()


def test_a_client_that_decodes_replies_works_too(redis_url, tenant):
    text = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        token, key = keys.create(text, tenant, rpm=1, name="é")
        assert keys.authenticate(text, token) == key
        assert keys.list_keys(text, tenant) == [key]
        assert keys.admit(text, key, 0) == 0.0 and keys.admit(text, key, 0) > 59
    finally:
        text.close()


def test_redis_holds_no_secret(tmp_path, tenant):
    server = RedisServer(tmp_path)  # its own: every key in it is read below
    server.start()
    client = redis.Redis.from_url(server.url)
    try:
        _holds_no_secret(client, tenant)
    finally:
        client.close()
        server.stop()


def _holds_no_secret(client: redis.Redis, tenant: str) -> None:
    tokens = [keys.create(client, tenant, rpm=10, tpm=100)[0] for _ in range(3)]
    for token in tokens:
        keys.admit(client, keys.authenticate(client, token), 10)
    secrets_ = [_secret(t) for t in tokens]
    found = 0
    for name in client.scan_iter(count=1000):
        kind = client.type(name)
        values: list[bytes] = [name]
        if kind == b"hash":
            for f, v in client.hgetall(name).items():
                values += [f, v]
        elif kind == b"string":
            values.append(client.get(name))
        elif kind == b"set":
            values += list(client.smembers(name))
        elif kind == b"list":
            values += client.lrange(name, 0, -1)
        elif kind == b"zset":
            values += [m for m, _ in client.zrange(name, 0, -1, withscores=True)]
        for secret in secrets_:
            assert not any(secret.encode() in v for v in values), name
        found += 1
    assert found
    digests = {client.hget(api_key(t.split("-")[1]), "digest") for t in tokens}
    assert digests == {hashlib.sha256(s.encode()).hexdigest().encode() for s in secrets_}


# -- rate limits ---------------------------------------------------------------------
def test_admit_requests_per_minute(client, tenant):
    token, _ = keys.create(client, tenant, rpm=3)
    key = keys.authenticate(client, token)
    assert [keys.admit(client, key, 0) for _ in range(3)] == [0.0, 0.0, 0.0]  # a minute's burst
    wait = keys.admit(client, key, 0)
    assert 19.0 < wait <= 20.0, wait  # one request's share of the minute comes back
    again = keys.admit(client, key, 0)
    assert 18.5 < again <= wait, "a refused request is not counted"


def test_admit_waits_exactly_as_long_as_it_says(client, tenant):
    _, key = keys.create(client, tenant, rpm=120)  # one request back every 0.5 s
    while keys.admit(client, key, 0) == 0.0:
        pass
    wait = keys.admit(client, key, 0)
    assert 0 < wait <= 0.5
    start = time.monotonic()
    wait_for(lambda: keys.admit(client, key, 0) == 0.0, 5, "admitted after its retry time")
    waited = time.monotonic() - start
    assert waited >= wait - 0.02, (waited, wait)


def test_admit_tokens_per_minute(client, tenant):
    _, key = keys.create(client, tenant, tpm=1000)
    assert keys.admit(client, key, 600) == 0.0
    wait = keys.admit(client, key, 600)  # 1200 > 1000: 200 tokens must come back first
    assert 11.5 < wait <= 12.0, wait
    assert keys.admit(client, key, 400) == 0.0  # 1000 fit
    assert keys.admit(client, key, 1) > 0


def test_a_request_over_a_minutes_tokens_is_admitted_when_the_key_owes_nothing(client, tenant):
    _, key = keys.create(client, tenant, rpm=100, tpm=1000)
    assert keys.admit(client, key, 5000) == 0.0  # idle: admitted, owes 5 minutes
    wait = keys.admit(client, key, 1)  # 5 min owed, plus 1 token's 60 ms, less a minute
    assert 239.5 < wait <= 240.06, wait


def test_both_limits_count_only_when_both_admit(client, tenant):
    _, key = keys.create(client, tenant, rpm=1, tpm=100)
    assert keys.admit(client, key, 100) == 0.0
    assert keys.admit(client, key, 0) > 0  # the request limit refuses
    state = client.hgetall(api_key_rate(key.id))
    assert set(state) == {b"r", b"c"}
    assert 0 < client.pttl(api_key_rate(key.id)) <= 61_000


def test_a_key_without_limits_touches_nothing(client, tenant):
    _, key = keys.create(client, tenant)
    assert all(keys.admit(client, key, 10**6) == 0.0 for _ in range(5))
    assert not client.exists(api_key_rate(key.id))
    with pytest.raises(InvalidArgument):
        keys.admit(client, key, -1)


# -- the command line ------------------------------------------------------------------
def test_cli_create_list_revoke(client, redis_url, tenant):
    runner = CliRunner()
    made = runner.invoke(cli, ["keys", "create", "--tenant", tenant, "--priority", "batch",
                               "--rpm", "30", "--name", "night job", "--redis", redis_url])
    assert made.exit_code == 0, made.output
    token = made.stdout.strip()
    assert token.startswith("mtq-") and "\n" not in token
    assert "cannot be shown again" in made.stderr
    key = keys.authenticate(client, token)
    assert (key.tenant, key.priority, key.rpm, key.tpm, key.name) == (
        tenant, "batch", 30, None, "night job")

    as_json = runner.invoke(cli, ["keys", "create", "--tenant", tenant, "--tpm", "9",
                                  "--json", "--redis", redis_url])
    assert as_json.exit_code == 0, as_json.output
    record = json.loads(as_json.stdout)
    assert keys.authenticate(client, record["token"]).id == record["id"]
    assert record["tpm"] == 9 and record["tenant"] == tenant

    listed = runner.invoke(cli, ["keys", "list", "--tenant", tenant, "--json",
                                 "--redis", redis_url])
    assert listed.exit_code == 0, listed.output
    rows = json.loads(listed.stdout)
    assert [r["id"] for r in rows] == [key.id, record["id"]]
    assert "token" not in rows[0] and "digest" not in rows[0]
    table = runner.invoke(cli, ["keys", "list", "--tenant", tenant, "--redis", redis_url])
    assert table.exit_code == 0, table.output
    assert key.id in table.stdout and tenant in table.stdout and "night" in table.stdout
    for out in (listed.output, table.output):
        assert _secret(token) not in out and _secret(record["token"]) not in out

    revoked = runner.invoke(cli, ["keys", "revoke", key.id, "--redis", redis_url])
    assert revoked.exit_code == 0 and key.id in revoked.stdout
    with pytest.raises(InvalidApiKey):
        keys.authenticate(client, token)
    unknown = runner.invoke(cli, ["keys", "revoke", "0123456789ab", "--redis", redis_url])
    assert unknown.exit_code == 3 and "mtq keys list" in unknown.stderr


def test_admin_keys(client, redis_url, tenant):
    token, key = keys.create(client, tenant, admin=True, name="ops")
    assert key.admin is True
    assert keys.authenticate(client, token) == key
    plain_token, plain = keys.create(client, tenant)
    assert plain.admin is False and keys.authenticate(client, plain_token).admin is False
    assert {k.id: k.admin for k in keys.list_keys(client, tenant)} == {key.id: True,
                                                                       plain.id: False}
    # a record written before keys had the flag reads as not admin
    client.hdel(api_key(plain.id), "admin")
    assert keys.authenticate(client, plain_token).admin is False

    runner = CliRunner()
    made = runner.invoke(cli, ["keys", "create", "--tenant", tenant, "--admin", "--json",
                               "--redis", redis_url])
    assert made.exit_code == 0, made.output
    record = json.loads(made.stdout)
    assert record["admin"] is True and keys.authenticate(client, record["token"]).admin
    said = runner.invoke(cli, ["keys", "create", "--tenant", tenant, "--admin",
                               "--redis", redis_url])
    assert said.exit_code == 0 and "admin key" in said.stderr, said.output
    listed = runner.invoke(cli, ["keys", "list", "--tenant", tenant, "--json",
                                 "--redis", redis_url])
    assert [r["admin"] for r in json.loads(listed.stdout)] == [True, False, True, True]
    table = runner.invoke(cli, ["keys", "list", "--tenant", tenant, "--redis", redis_url])
    assert table.exit_code == 0 and f"{key.id}*" in table.stdout, table.output
    assert f"{plain.id}*" not in table.stdout and "* an admin key" in table.stdout
    # an admin key still needs a tenant (it acts as that tenant on the gateway)
    refused = runner.invoke(cli, ["keys", "create", "--admin", "--redis", redis_url])
    assert refused.exit_code == 2 and "--tenant" in refused.output


@pytest.mark.parametrize("args", [
    ["keys", "create"],                                      # no tenant
    ["keys", "create", "--tenant", "has space"],
    ["keys", "create", "--tenant", "t", "--priority", "urgent"],
    ["keys", "create", "--tenant", "t", "--rpm", "0"],
    ["keys", "create", "--tenant", "t", "--tpm", "many"],
    ["keys", "list", "--tenant", "has space"],
])
def test_cli_bad_input_exits_2(redis_url, args):
    result = CliRunner().invoke(cli, [*args, "--redis", redis_url])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output


def test_cli_unreachable_redis_exits_5(unreachable_url):
    result = CliRunner().invoke(cli, ["keys", "list", "--redis", unreachable_url])
    assert result.exit_code == 5, result.output


def test_cli_list_without_a_server_exits_3():
    result = CliRunner().invoke(cli, ["keys", "list"])  # no URL, embedded not running
    assert result.exit_code == 3, result.output


# -- Redis Cluster -----------------------------------------------------------------------
@pytest.mark.timeout(180)
def test_keys_work_on_a_redis_cluster(redis_cluster):
    """Each key's hash is in a slot of its own: every call goes through the cluster
    client (shared()), also when it is given a queue's slot client. The session's
    cluster (tests/integration/conftest.py), a tenant of this test's own."""
    from mtq.broker.cluster import for_queue
    from mtq.broker.connection import connect

    c = redis_cluster
    tenant = "acme-" + uuid.uuid4().hex[:8]
    whole = connect(c.url)
    slot_client = for_queue(whole, "chat")  # what a gateway holding a queue has
    made = [keys.create(slot_client if i % 2 else whole, tenant, rpm=2) for i in range(6)]
    assert len({c.owner(api_key(k.id)).port for _, k in made}) > 1, "all on one node"
    assert {k.id for k in keys.list_keys(slot_client, tenant)} == {k.id for _, k in made}
    for token, key in made:
        assert keys.authenticate(slot_client, token) == key
        assert keys.admit(slot_client, key, 0) == 0.0
        assert keys.admit(whole, key, 0) == 0.0
        assert 29 < keys.admit(slot_client, key, 0) <= 30
    assert keys.revoke(slot_client, made[0][1].id) and keys.any_keys(slot_client)
    with pytest.raises(InvalidApiKey):
        keys.authenticate(whole, made[0][0])
