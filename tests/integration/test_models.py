"""``mtq models``: the model catalogue and its history, with real worker processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import redis

from mtq.workers import control
from tests.support.waits import wait_for
from tests.support.workers import registered_worker


def models(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mtq", "models", *args],
                          env={**env, "COLUMNS": "250"},
                          capture_output=True, text=True, timeout=60)


def test_models_live_history_and_reload(qname: str, r: redis.Redis,
                                        subprocess_env: dict[str, str],
                                        tmp_path: Path) -> None:
    version = tmp_path / "version"
    version.write_text("v1")
    env = {**subprocess_env, "MTQ_TEST_VERSION_FILE": str(version)}
    log = tmp_path / "calls.log"
    with registered_worker("tests.models:Versioned", qname, env, log) as proc:
        out = models(env, "--json", "-q", qname)
        assert out.returncode == 0, out.stderr
        data = json.loads(out.stdout)
        (row,) = data["models"]
        assert (row["queue"], row["version"], row["replicas"], row["kind"]) == \
            (qname, "v1", 1, "model")
        assert row["target"] == "tests.models:Versioned" and row["devices"] == ["cpu"]
        assert data["history"][0]["event"] == "loaded"
        assert data["history"][0]["pid"] == proc.pid
        text = models(env, "-q", qname)
        assert text.returncode == 0 and "tests.models:Versioned" in text.stdout
        version.write_text("v2")
        assert control.send(r, qname, "reload") >= 1
        wait_for(lambda: json.loads(models(env, "--json", "-q", qname).stdout)["models"][0]
                 ["version"] == "v2", 30, "mtq models never showed the reloaded version")
    history = json.loads(models(env, "--json", "-q", qname).stdout)["history"]
    assert [h["event"] for h in history] == ["stopped", "reloaded", "loaded"]
    assert [h["version"] for h in history] == ["v2", "v2", "v1"]
    rows = json.loads(models(env, "--json", "-q", qname).stdout)["models"]
    assert [(m["version"], m["replicas"]) for m in rows] == [("v2", 0)]


def test_computed_version_for_an_unversioned_function(qname: str, r: redis.Redis,
                                                      subprocess_env: dict[str, str],
                                                      tmp_path: Path) -> None:
    with registered_worker("tests.handlers:gated", qname, subprocess_env, tmp_path / "log"):
        data = json.loads(models(subprocess_env, "--json", "-q", qname).stdout)
    (row,) = data["models"]
    assert row["version"].startswith("h-") and row["kind"] == "function"


def test_unknown_queue_exits_3(subprocess_env: dict[str, str]) -> None:
    out = models(subprocess_env, "-q", "no-such-queue-xyz")
    assert out.returncode == 3 and "unknown queue" in out.stderr
