"""Names that end up in Redis keys, and the settings dataclasses."""

from __future__ import annotations

import pytest

import mtq
from mtq.errors import ConfigError, InvalidName
from mtq.settings import QueueSettings, RedisSettings
from mtq.validation import MAX_STREAM_BYTES, check_queue_name, check_stream_name, check_task_id


# -- queue names -----------------------------------------------------------------
@pytest.mark.parametrize("name", ["q", "embed", "chat-v2", "a.b_c-d", "0abc", "Q" * 100,
                                  "A1", "x_"])
def test_valid_queue_names(name):
    assert check_queue_name(name) == name


@pytest.mark.parametrize("name", [
    "", "a b", "a{b}", "{a}", "a:b", "a" * 101, "-a", "_a", ".a", "a\n", "a/b", "ü", "a*",
    None, 1, b"abc", ["a"],
], ids=repr)
def test_invalid_queue_names(name):
    with pytest.raises(InvalidName) as info:
        check_queue_name(name)
    assert isinstance(info.value, ValueError)
    assert "invalid queue name" in str(info.value)
    assert "e.g." in str(info.value)  # says what would be valid


# -- stream names ----------------------------------------------------------------
@pytest.mark.parametrize("name", ["user-42", "a@b.com", "ユーザー", "x", "session:1/2{3}",
                                  "é" * (MAX_STREAM_BYTES // 2), "a" * MAX_STREAM_BYTES])
def test_valid_stream_names(name):
    assert check_stream_name(name) == name


@pytest.mark.parametrize("name", [
    "", "a b", "a\nb", "a\tb", "a\x00b", "\u00a0", "a\u200bb", "x" * 300,
    "é" * (MAX_STREAM_BYTES // 2 + 1), None, 42, b"user",
], ids=lambda v: repr(v)[:20])
def test_invalid_stream_names(name):
    with pytest.raises(InvalidName):
        check_stream_name(name)


def test_stream_length_is_counted_in_utf8_bytes():
    name = "ユ" * 100  # 100 characters, 300 bytes
    with pytest.raises(InvalidName, match="300 bytes"):
        check_stream_name(name)


def test_stream_error_names_what_was_checked():
    with pytest.raises(InvalidName, match="idempotency key"):
        check_stream_name("a b", "idempotency key")


# -- task ids --------------------------------------------------------------------
@pytest.mark.parametrize("tid", ["a", "abc-DEF_123", "x" * 64, "0"])
def test_valid_task_ids(tid):
    assert check_task_id(tid) == tid


@pytest.mark.parametrize("tid", ["", "x" * 65, "a b", "a:b", "a.b", "ü", "a\n", None, 7],
                         ids=repr)
def test_invalid_task_ids(tid):
    with pytest.raises(InvalidName, match="invalid task id"):
        check_task_id(tid)


def test_generated_task_ids_are_valid_and_distinct():
    from mtq.client import new_task_id

    ids = {new_task_id() for _ in range(200)}
    assert len(ids) == 200
    for tid in ids:
        assert check_task_id(tid) == tid


def test_generated_task_ids_never_start_with_a_dash():
    # `mtq cancel -Mx...` would read as an option; 1 draw in 64 starts with "-", so
    # 20,000 ids would hold ~310 of them if the generator did not redraw
    from mtq.client import new_task_id

    bad = [tid for tid in (new_task_id() for _ in range(20_000)) if tid.startswith("-")]
    assert not bad, f"generated ids starting with '-': {bad[:3]}"
    assert len(new_task_id()) == 16


# -- QueueSettings ---------------------------------------------------------------
def test_queue_settings_defaults_are_valid():
    s = QueueSettings()
    assert s.max_length == 0 and s.lease_ms > 0 and s.dead_letter is True


def test_from_dict_builds_and_rejects_unknown_key():
    s = QueueSettings.from_dict({"max_length": 10, "lease_ms": 500})
    assert (s.max_length, s.lease_ms) == (10, 500)
    with pytest.raises(ConfigError) as info:
        QueueSettings.from_dict({"lease_ms": 500, "leese_ms": 1})
    msg = str(info.value)
    assert "leese_ms" in msg
    assert "lease_ms" in msg  # lists the known settings
    assert isinstance(info.value, ValueError) and isinstance(info.value, mtq.MtqError)


def test_from_dict_names_every_unknown_key():
    with pytest.raises(ConfigError) as info:
        QueueSettings.from_dict({"zzz": 1, "aaa": 2})
    assert "aaa" in str(info.value) and "zzz" in str(info.value)


@pytest.mark.parametrize("changes", [
    {"max_length": -1}, {"max_payload_bytes": 0}, {"lease_ms": 0}, {"max_deliveries": 0},
    {"max_retries": -1}, {"retry_backoff_ms": -5}, {"retention_s": 0},
    {"dead_retention_s": 0}, {"dead_max": 0}, {"idempotency_window_s": 0},
    {"wake_cap": 0}, {"reap_limit": 0},
], ids=lambda d: next(iter(d)))
def test_out_of_range_raises_config_error(changes):
    (name,) = changes
    with pytest.raises(ConfigError, match=name):
        QueueSettings(**changes)
    with pytest.raises(ConfigError, match=name):
        QueueSettings.from_dict(changes)
    with pytest.raises(ConfigError, match=name):
        QueueSettings().replace(**changes)


@pytest.mark.parametrize("value", [1.5, "10", True, None])
def test_int_settings_reject_non_integers(value):
    with pytest.raises(ConfigError, match="must be an integer"):
        QueueSettings(lease_ms=value)


def test_replace_changes_only_what_is_given():
    base = QueueSettings(max_length=5, lease_ms=1000)
    new = base.replace(lease_ms=2000)
    assert (new.max_length, new.lease_ms) == (5, 2000)
    assert base.lease_ms == 1000  # frozen original untouched


def test_replace_unknown_key_raises():
    with pytest.raises(ConfigError, match="bogus"):
        QueueSettings().replace(bogus=1)


def test_settings_are_frozen():
    import dataclasses

    with pytest.raises(dataclasses.FrozenInstanceError):
        QueueSettings().lease_ms = 1  # type: ignore[misc]


# -- RedisSettings ---------------------------------------------------------------
def test_redis_settings_from_env():
    assert RedisSettings.from_env({"MTQ_REDIS_URL": "redis://x"}).url == "redis://x"
    assert RedisSettings.from_env({}).url is None
    assert RedisSettings.from_env({"MTQ_REDIS_URL": ""}).url is None


def test_redis_settings_from_env_reads_process_env(monkeypatch):
    monkeypatch.setenv("MTQ_REDIS_URL", "redis://from-env:6379/2")
    assert RedisSettings.from_env().url == "redis://from-env:6379/2"
    monkeypatch.delenv("MTQ_REDIS_URL")
    assert RedisSettings.from_env().url is None


def test_redis_settings_from_dict():
    s = RedisSettings.from_dict({"url": "redis://h", "socket_timeout": 1.0})
    assert (s.url, s.socket_timeout) == ("redis://h", 1.0)
    with pytest.raises(ConfigError, match="sockettimeout"):
        RedisSettings.from_dict({"sockettimeout": 1})
