"""A user's own code is importable as a target from the directory that holds it, as
``rq worker``, ``celery -A`` and ``uvicorn`` users expect, in supervised worker
processes too; ``--app-dir`` names another directory. Run through the installed
``mtq`` command with no PYTHONPATH, as a new user would."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

import mtq
from tests.support.waits import wait_for

MODELS = '''
import mtq


class Doubler(mtq.Model):
    max_batch_size, max_wait_ms = 8, 1

    def setup(self, device):
        self.k = 2

    def predict(self, batch):
        return [p["x"] * self.k for p in batch]


def triple(payload):
    return payload["x"] * 3
'''


@pytest.fixture
def project(tmp_path: Path) -> Path:
    app = tmp_path / "project" / "myapp"
    app.mkdir(parents=True)
    (app / "__init__.py").write_text("")
    (app / "models.py").write_text(MODELS)
    return app.parent


@pytest.fixture
def user_env(redis_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["MTQ_REDIS_URL"] = redis_url
    return env


def mtq_command() -> str:
    found = shutil.which("mtq")
    assert found, "the mtq console script is not installed"
    return found


def test_workers_start_imports_from_the_current_directory(
        project: Path, user_env: dict[str, str], redis_url: str, qname: str,
        tmp_path: Path) -> None:
    log = tmp_path / "sup.log"
    with open(log, "wb") as out:
        sup = subprocess.Popen([mtq_command(), "workers", "start", "myapp.models:Doubler",
                                "--queue", qname], cwd=project, env=user_env, stdout=out,
                               stderr=subprocess.STDOUT, start_new_session=True)
    try:
        assert mtq.Queue(qname, redis_url).submit({"x": 4}).result(timeout=60) == 8, \
            log.read_text()
        wait_for(lambda: "standby ready" in log.read_text(), 30,
                 "the standby (a process of its own) did not import the target")
        sup.terminate()
        assert sup.wait(30) == 0, log.read_text()
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait(10)
    assert "Traceback" not in log.read_text(), log.read_text()


def test_app_dir_names_another_directory(project: Path, user_env: dict[str, str],
                                         redis_url: str, qname: str, tmp_path: Path) -> None:
    task = mtq.Queue(qname, redis_url).submit({"x": 5})
    done = subprocess.run([mtq_command(), "worker", "run", "myapp.models:triple", "--queue",
                           qname, "--burst", "--app-dir", str(project)], cwd=tmp_path,
                          env=user_env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done
    assert task.result(timeout=5) == 15


def test_without_it_the_error_says_where_mtq_looked(user_env: dict[str, str], qname: str,
                                                    tmp_path: Path) -> None:
    done = subprocess.run([mtq_command(), "worker", "run", "myapp.models:triple", "--queue",
                           qname], cwd=tmp_path, env=user_env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2, done
    assert "No module named 'myapp'" in done.stderr and "--app-dir" in done.stderr, done
    assert str(tmp_path) in done.stderr and done.stderr.count("\n") == 1, done.stderr
    bad = subprocess.run([mtq_command(), "worker", "run", "myapp.models:triple", "--queue",
                          qname, "--app-dir", str(tmp_path / "nope")], env=user_env,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "nope" in bad.stderr, bad
