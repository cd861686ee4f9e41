"""Model options from the command line (``--set KEY=VALUE`` on ``mtq workers start``
and ``mtq worker run``): refused before any process starts or Redis is reached when
the target cannot take them; given to every worker process's model before its
``setup``, kept across a reload, recorded in the model catalogue (``mtq models``)
and in the version. Real ``mtq`` processes against the session's redis-server; the
target is ``tests.models:Configured``, whose results say what its setup saw."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import redis

import mtq
from mtq.broker import catalogue as cat
from mtq.workers.registry import list_workers
from tests.support.paths import PY
from tests.support.processes import free_port
from tests.support.supervisors import StartFn, wait_workers
from tests.support.waits import wait_for
from tests.support.workers import registered_worker

pytestmark = pytest.mark.timeout(120)

TARGET = "tests.models:Configured"
COMMANDS = (["worker", "run"], ["workers", "start"])


def mtq_cli(env: dict[str, str], *args: str, timeout: float = 60
            ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-m", "mtq", *args], env={**env, "COLUMNS": "250"},
                          capture_output=True, text=True, timeout=timeout)


def flat(text: str) -> str:
    """rich wraps long lines: join the words again."""
    return " ".join(text.split())


def models_json(env: dict[str, str], qname: str) -> dict[str, Any]:
    out = mtq_cli(env, "models", "--json", "-q", qname)
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))


# -- refused before anything starts ------------------------------------------------------
BAD_SETS = {
    "unknown": (["--set", "model=/a", "--set", "poolng=cls"],
                "'tests.models:Configured' has no option 'poolng' (did you mean "
                "'pooling'?); its options: model (str, required)"),
    "malformed": (["--set", "model"], "--set takes KEY=VALUE, got 'model'"),
    "twice": (["--set", "model=/a", "--set", "model=/b"], "--set model is given twice"),
    "required": (["--set", "layers=3"], "'tests.models:Configured': option 'model' is "
                                        "required: give it with --set model=VALUE"),
    "type": (["--set", "model=/a", "--set", "layers=many"],
             "option 'layers' takes an integer, got 'many'"),
    "range": (["--set", "model=/a", "--set", "layers=9"],
              "option 'layers' must be >= 1 and <= 8"),
    "bool": (["--set", "model=/a", "--set", "normalize=perhaps"],
             "option 'normalize' takes true or false"),
}
#: both commands check --set with the same function (mtq/cli/workers.py, _model_options):
#: the default run gives `mtq worker run` every case and `mtq workers start` one of each
#: kind (parse, target's options, required); its other cases are slow tests
START_CASES = ("unknown", "malformed", "required")


@pytest.mark.parametrize("command,sets,says", [
    pytest.param(command, sets, says, id=f"{case}-{cid}",
                 marks=[pytest.mark.slow] if cid == "workers-start"
                 and case not in START_CASES else [])
    for case, (sets, says) in BAD_SETS.items()
    for command, cid in zip(COMMANDS, ("worker-run", "workers-start"))])
def test_a_bad_option_exits_2_before_redis_is_reached(command: list[str], sets: list[str],
                                                      says: str, qname: str,
                                                      subprocess_env: dict[str, str]) -> None:
    # nobody serves this address and the wait for it is long: exit 2 at once shows
    # that nothing tried to reach it (and so no process was started to serve)
    env = dict(subprocess_env, MTQ_REDIS_WAIT_S="60")
    t0 = time.monotonic()
    out = mtq_cli(env, *command, TARGET, "--queue", qname, "--redis",
                  f"redis://127.0.0.1:{free_port()}/0", *sets, timeout=30)
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    err = flat(out.stderr)
    assert says in err, err
    assert "cannot reach" not in err and "serving" not in err and "Traceback" not in err
    assert not out.stdout.strip(), out.stdout
    assert time.monotonic() - t0 < 20


def test_a_bad_option_starts_no_worker(qname: str, r: redis.Redis,
                                       subprocess_env: dict[str, str]) -> None:
    for command in COMMANDS:
        out = mtq_cli(subprocess_env, *command, TARGET, "-q", qname, "--set", "nope=1")
        assert out.returncode == 2 and "has no option 'nope'" in out.stderr, out.stderr
    assert list_workers(r, qname) == []
    assert cat.models(r, [qname]) == {} and cat.history(r, 10, qname) == []


@pytest.mark.parametrize("command", COMMANDS, ids=["worker-run", "workers-start"])
def test_a_plain_function_takes_no_options(command: list[str], qname: str,
                                           subprocess_env: dict[str, str]) -> None:
    out = mtq_cli(subprocess_env, *command, "tests.handlers:double", "-q", qname,
                  "--redis", f"redis://127.0.0.1:{free_port()}/0", "--set", "x=1")
    assert out.returncode == 2, out
    assert "'tests.handlers:double'" in flat(out.stderr)
    assert "declares no options (--set x=...)" in flat(out.stderr), out.stderr


def test_a_required_option_not_given_at_all_stops_the_supervisor_with_exit_2(
        supervise: StartFn, qname: str, r: redis.Redis) -> None:
    # with no --set the supervisor does not import the target: its first worker
    # process reports the missing option, and nothing is restarted
    sup = supervise(TARGET, qname, "--standby", "0")
    code = sup.wait_exit(60, "with a required option missing")
    out = sup.output()
    assert code == 2, out
    assert "option 'model' is required: give it with --set model=VALUE" in out, out
    assert "restarting" not in out, "a crash loop"
    wait_for(lambda: not sup.group_alive(), 10, "worker processes left after the supervisor")
    assert [w for w in list_workers(r, qname) if w.get("role") != "quarantine"] == []


# -- given to the model, kept, recorded ------------------------------------------------------
def test_options_reach_setup_are_recorded_and_survive_a_reload(
        supervise: StartFn, qname: str, redis_url: str, r: redis.Redis,
        subprocess_env: dict[str, str], tmp_path: Path) -> None:
    sets = ["--set", "model=/srv/a", "--set", "layers=3", "--set", "normalize=off",
            "--set", "scale=0.25", "--set", "revision=none"]
    sup = supervise(TARGET, qname, "--standby", "0", *sets)
    wait_workers(r, qname, 1, sup)
    q = mtq.Queue(qname, redis_url)
    first = q.submit({}).result(timeout=30)
    expected = {"model": "/srv/a", "pooling": "mean", "normalize": False, "layers": 3,
                "scale": 0.25, "revision": None}
    assert first["options"] == expected
    assert f"serving {qname!r} with {TARGET} --set model=/srv/a --set layers=3" in sup.output()

    given = {"model": "/srv/a", "layers": 3, "normalize": False, "scale": 0.25,
             "revision": None}
    data = models_json(subprocess_env, qname)
    (row,) = data["models"]
    assert row["options"] == given and row["replicas"] == 1, row
    version = row["version"]
    assert version.startswith("h-")
    assert data["history"][0]["event"] == "loaded"
    assert data["history"][0]["options"] == given
    table = mtq_cli(subprocess_env, "models", "-q", qname)
    assert table.returncode == 0, table.stderr
    assert "layers=3 model=/srv/a normalize=false revision=none scale=0.25" in \
        flat(table.stdout), table.stdout

    out = mtq_cli(subprocess_env, "workers", "reload", "-q", qname)
    assert out.returncode == 0, out.stderr
    assert "reload: 1 of 1 engine(s) ok" in out.stdout, out.stdout  # it waited for it
    wait_for(lambda: [h for h in cat.history(r, 10, qname) if h["event"] == "reloaded"],
             30, f"no reloaded event\n{sup.output()[-3000:]}")
    again = q.submit({}).result(timeout=30)
    assert again["setup_at"] > first["setup_at"], "the reload ran setup again"
    assert again["pid"] == first["pid"], "reloaded in place, not restarted"
    assert again["options"] == expected
    data = models_json(subprocess_env, qname)
    (row,) = data["models"]
    assert (row["options"], row["version"]) == (given, version), row
    reloaded = [h for h in data["history"] if h["event"] == "reloaded"]
    assert reloaded and reloaded[0]["options"] == given

    # another option set, served by `mtq worker run`, is another version
    other = f"{qname}-b"
    with registered_worker(TARGET, other, subprocess_env, tmp_path / "calls.log",
                           "--set", "model=/srv/b", "--set", "pooling=cls"):
        res = mtq.Queue(other, redis_url).submit({}).result(timeout=30)
        assert res["options"] == {**expected, "model": "/srv/b", "pooling": "cls",
                                  "normalize": True, "layers": 2, "scale": 1.0}
        (row_b,) = models_json(subprocess_env, other)["models"]
    assert row_b["options"] == {"model": "/srv/b", "pooling": "cls"}
    assert row_b["version"].startswith("h-") and row_b["version"] != version
