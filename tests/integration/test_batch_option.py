"""One name for the batch size: ``--max-batch-size`` on ``mtq worker run`` and ``mtq
workers start``, with ``--batch-size`` kept as an alias that --help does not show.
Each name is given to a real process of each command, which reports the batch size in
force in the registry (``batch_cap``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
from click.testing import CliRunner

from mtq.cli.main import cli
from mtq.workers.registry import list_workers
from tests.support.processes import kill_process, worker_process
from tests.support.supervisors import StartFn, wait_workers
from tests.support.waits import wait_for

pytestmark = pytest.mark.timeout(90)

NAMES = pytest.mark.parametrize("name", ["--max-batch-size", "--batch-size"])


@pytest.mark.parametrize("command", [["worker", "run"], ["workers", "start"]])
def test_help_shows_the_one_name(command: list[str]) -> None:
    out = CliRunner().invoke(cli, [*command, "--help"], env={"COLUMNS": "200"}).output
    assert "--max-batch-size" in out
    assert "--batch-size" not in out.replace("--max-batch-size", ""), out


@NAMES
def test_worker_run_takes_both_names(name: str, qname: str, r: redis.Redis,
                                     subprocess_env: dict[str, str], tmp_path: Path) -> None:
    with open(tmp_path / "w.log", "wb") as log:
        proc = worker_process(["tests.models:Probe", "--queue", qname, name, "3"],
                              subprocess_env, log)
    try:
        (w,) = wait_for(lambda: list_workers(r, qname), 30,
                        f"the worker registered: {(tmp_path / 'w.log').read_text()}")
        assert w["batch_cap"] == 3, w  # the model's own max_batch_size is 4
    finally:
        kill_process(proc)


# one click option serves both commands (mtq/cli/workers.py, _max_batch_opt): the alias
# reaches a worker of `mtq worker run` above; `mtq workers start` with the alias is a
# slow test
@pytest.mark.parametrize("name", ["--max-batch-size",
                                  pytest.param("--batch-size", marks=pytest.mark.slow)])
def test_workers_start_takes_both_names(name: str, supervise: StartFn, qname: str,
                                        r: redis.Redis) -> None:
    sup = supervise("tests.models:Probe", qname, "--standby", "0", name, "3")
    (w,) = wait_workers(r, qname, 1, sup)
    assert w["batch_cap"] == 3, w


@NAMES
def test_a_bad_value_names_the_one_name(name: str, redis_url: str) -> None:
    res = CliRunner().invoke(cli, ["worker", "run", "tests.models:Probe", "-q", "q", name,
                                   "0", "--redis", redis_url])
    assert res.exit_code == 2 and "'--max-batch-size'" in res.output, res.output
