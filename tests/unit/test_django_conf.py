"""mtq.contrib.django without Redis or a server: the MTQ setting's checks (named
errors, nothing half-read), the worker-target source check, the command line that
reaches mtq's click commands, and the package's public names."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured

import mtq.contrib.django as mtqd
from mtq.contrib.django.checks import _defines
from mtq.contrib.django.commands import _strip_django_options
from mtq.contrib.django.conf import MtqSettings, MtqSettingsError
from mtq.errors import ConfigError


def test_defaults_and_a_full_setting() -> None:
    assert MtqSettings.from_dict(None) == MtqSettings()
    s = MtqSettings.from_dict({"REDIS_URL": "redis://h:1/0", "QUEUE": "chat",
                               "WORKERS": "pkg.mod:Model", "RETRY_AFTER_S": 5,
                               "KEEPALIVE_S": 2, "CHECK_TIMEOUT_S": 0.5,
                               "STREAM_OF": "mtq.contrib.django.user_stream",
                               "TENANT_OF": "mtq.contrib.django.user_tenant",
                               "PRIORITY_OF": mtqd.request_priority})
    assert (s.redis_url, s.queue, s.workers, s.retry_after_s) == (
        "redis://h:1/0", "chat", "pkg.mod:Model", 5)
    assert (s.keepalive_s, s.check_timeout_s, s.stream_of) == (2.0, 0.5, mtqd.user_stream)
    assert (s.tenant_of, s.priority_of) == (mtqd.user_tenant, mtqd.request_priority)


@pytest.mark.parametrize(("raw", "says"), [
    ([("QUEUE", "x")], "must be a dict"),
    ({"REDIS_UR": "redis://h"}, "unknown key(s) in settings.MTQ: REDIS_UR"),
    ({"QUEUE": "has space"}, "MTQ['QUEUE']"),
    ({"QUEUE": ""}, "non-empty string"),
    ({"WORKERS": "no_colon"}, "package.module:attr"),
    ({"RETRY_AFTER_S": 1.5}, "whole seconds"),
    ({"RETRY_AFTER_S": True}, "RETRY_AFTER_S"),
    ({"KEEPALIVE_S": 0}, "KEEPALIVE_S"),
    ({"CHECK_TIMEOUT_S": "1"}, "CHECK_TIMEOUT_S"),
    ({"STREAM_OF": "no.such.module.fn"}, "cannot be imported"),
    ({"STREAM_OF": 3}, "must be a callable"),
    ({"TENANT_OF": "no.such.module.fn"}, "MTQ['TENANT_OF'] cannot be imported"),
    ({"PRIORITY_OF": "batch"}, "MTQ['PRIORITY_OF'] cannot be imported"),
    ({"PRIORITY_OF": 3}, "MTQ['PRIORITY_OF'] must be a callable"),
])
def test_a_bad_setting_is_a_named_error(raw: object, says: str) -> None:
    with pytest.raises(MtqSettingsError) as err:
        MtqSettings.from_dict(raw)
    assert says in str(err.value)
    assert isinstance(err.value, ConfigError) and isinstance(err.value, ImproperlyConfigured)


def test_the_target_check_reads_the_source(tmp_path: Path) -> None:
    mod = tmp_path / "m.py"
    mod.write_text("import os as o\nfrom x import y\nA = 1\nclass Model: pass\n"
                   "def handle(p): return p\ntry:\n    import z\nexcept ImportError:\n"
                   "    Fallback = None\n")
    for name in ("o", "y", "A", "Model", "handle", "z", "Fallback"):
        assert _defines(str(mod), name) is True, name
    assert _defines(str(mod), "Missing") is False
    mod.write_text("from x import *\n")
    assert _defines(str(mod), "Missing") is None  # cannot tell: not an error
    mod.write_text("def __getattr__(name): ...\n")
    assert _defines(str(mod), "Missing") is None
    assert _defines(str(tmp_path / "absent.py"), "A") is None


def test_django_options_are_left_to_manage_py() -> None:
    assert _strip_django_options(["--settings", "s", "--json", "--pythonpath=/x", "q",
                                  "--redis", "redis://h"]) == [
        "--json", "q", "--redis", "redis://h"]


def test_public_names() -> None:
    assert sorted(mtqd.__all__) == [
        "MtqSettings", "MtqSettingsError", "aevent_stream", "asubmit", "error_response",
        "event_stream", "get_settings", "json_response", "priority_of", "queue",
        "request_priority", "stream_of", "submit", "submit_on_commit", "tenant_of",
        "user_stream", "user_tenant"]
    assert all(hasattr(mtqd, n) for n in mtqd.__all__)
