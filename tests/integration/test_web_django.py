"""The Django integration (mtq.contrib.django) in a real Django project
(tests/django_project): its sync views under a real gunicorn (gthread, WSGI), its
async views under a real uvicorn (ASGI), read by a real HTTP client (httpx,
streaming) against a real redis-server and real Workers; ``submit_on_commit`` with a
real SQLite transaction; ``manage.py check``, ``mtq_status`` and ``mtq_workers`` as
real subprocesses. The web contract every framework keeps (the stream, resume with
Last-Event-ID, 404/400, 503, cancel on disconnect) is tested in test_web_contract.py."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

import mtq
from mtq.settings import QueueSettings
from mtq.workers.registry import list_workers
from mtq.workers.worker import Worker
from tests.models import Counter
from tests.support.paths import ROOT
from tests.support.waits import wait_for
from tests.support.web import DjangoAsgiServer, DjangoWsgiServer, WebServer
from tests.support.workers import serving

pytestmark = pytest.mark.timeout(90)

FAST = QueueSettings(lease_ms=1500, retry_backoff_ms=0)
KEEPALIVE = 0.5
MANAGE = str(ROOT / "tests" / "django_project" / "manage.py")
#: an address nobody serves
NOWHERE = "redis://127.0.0.1:1/0"


def project_env(redis_url: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ, MTQ_REDIS_URL=redis_url,
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("DJANGO_SETTINGS_MODULE", None)
    for key in ("MTQ_DJANGO_REDIS_URL", "MTQ_DJANGO_WORKERS", "MTQ_QUEUE"):
        env.pop(key, None)
    env.update(extra)
    return env


def manage(env: dict[str, str], *args: str, timeout: float = 60
           ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, MANAGE, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def db(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The project's SQLite file, its table made (``migrate --run-syncdb``)."""
    path = str(tmp_path_factory.mktemp("django") / "db.sqlite3")
    out = manage(project_env(redis_url, MTQ_DJANGO_DB=path), "migrate", "--run-syncdb")
    assert out.returncode == 0, out.stdout + out.stderr
    return path


@pytest.fixture(scope="module")
def wsgi(redis_url: str, db: str, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[WebServer]:
    server = DjangoWsgiServer(redis_url, tmp_path_factory.mktemp("dj") / "gunicorn.log",
                              MTQ_WEB_KEEPALIVE=str(KEEPALIVE), MTQ_DJANGO_DB=db)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def asgi(redis_url: str, db: str, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[WebServer]:
    server = DjangoAsgiServer(redis_url, tmp_path_factory.mktemp("dj") / "uvicorn.log",
                              MTQ_WEB_KEEPALIVE=str(KEEPALIVE), MTQ_DJANGO_DB=db)
    server.start()
    yield server
    server.stop()


@dataclass
class Site:
    """One way of serving the project: sync views under gunicorn (``/q``) or async
    views under uvicorn (``/aq``)."""

    http: httpx.Client
    prefix: str

    def tasks(self, qname: str) -> str:
        return f"/{self.prefix}/{qname}/tasks"


@pytest.fixture(params=["wsgi", "asgi"])
def site(request: pytest.FixtureRequest) -> Iterator[Site]:
    server: WebServer = request.getfixturevalue(request.param)
    with httpx.Client(base_url=server.base, timeout=httpx.Timeout(10.0)) as c:
        yield Site(c, "q" if request.param == "wsgi" else "aq")


def worker(qname: str, redis_url: str, target: Any = None) -> Worker:
    return Worker(target or Counter(), qname, url=redis_url, settings=FAST)


def post(http: httpx.Client, path: str, payload: Any, **headers: str) -> dict[str, Any]:
    r = http.post(path, json=payload, headers=headers)
    assert r.status_code == 202, r.text
    return dict(r.json())


# -- the streams ------------------------------------------------------------------------
def test_each_user_and_session_has_its_own_fifo_stream(
        qname: str, redis_url: str, site: Site) -> None:
    q = mtq.Queue(qname, redis_url)
    mine = [post(site.http, site.tasks(qname), {"n": 3, "step_ms": 10, "i": i})
            for i in range(3)]
    stream = mine[0]["stream"]
    assert stream.startswith("session:") and {t["stream"] for t in mine} == {stream}
    with httpx.Client(base_url=str(site.http.base_url), timeout=10) as other:
        theirs = post(other, site.tasks(qname), {"n": 1})
    assert theirs["stream"].startswith("session:") and theirs["stream"] != stream
    ann = post(site.http, site.tasks(qname), {"n": 1}, **{"X-User": "ann"})
    assert ann["stream"] == "user:ann"  # a logged-in user: the user's, not the session's
    assert q.task(ann["id"]).info().stream == "user:ann"
    with serving(worker(qname, redis_url)) as run:
        for t in mine:
            q.task(t["id"]).result(timeout=10)
        run.stop()
    infos = [q.task(t["id"]).info() for t in mine]
    assert all(i.stream == stream for i in infos)
    for before, after in itertools.pairwise(infos):  # one at a time, in the order sent
        assert before.finished is not None and after.started is not None
        assert after.started >= before.finished, (before, after)


# -- submit_on_commit ---------------------------------------------------------------------
def test_submit_on_commit_submits_after_the_commit_and_never_on_rollback(
        qname: str, redis_url: str, wsgi: WebServer, r: redis.Redis) -> None:
    q = mtq.Queue(qname, redis_url)
    gate = "djgate-" + uuid.uuid4().hex[:8]
    with httpx.Client(base_url=wsgi.base, timeout=20) as http, \
            serving(worker(qname, redis_url, "tests.django_project.handlers:read_order")) as run:
        answer: dict[str, Any] = {}
        poster = threading.Thread(target=lambda: answer.update(resp=http.post(
            f"/q/{qname}/orders", json={"item": "tea", "gate": gate})))
        poster.start()
        got = r.blpop([f"{gate}:id"], timeout=10)
        assert got is not None, "the view did not reach its transaction"
        task_id = got[1].decode()
        # the row is written, the transaction open: the task is not in Redis
        with pytest.raises(mtq.TaskNotFound):
            q.task(task_id).status()
        assert q.stats()["waiting"] == 0
        r.rpush(f"{gate}:go", "1")  # commit
        poster.join(15)
        assert not poster.is_alive(), "the view did not answer after the commit"
        resp = answer["resp"]
        assert resp.status_code == 202, resp.text
        assert resp.json()["id"] == task_id
        # submitted after the commit; the worker, another process's connection, sees it
        assert q.task(task_id).result(timeout=10) == {"item": "tea"}

        rolled = http.post(f"/q/{qname}/orders", json={"item": "milk", "rollback": True})
        assert rolled.status_code == 200 and rolled.json()["committed"] is False
        with pytest.raises(mtq.TaskNotFound):
            q.task(rolled.json()["id"]).status()
        assert q.stats()["waiting"] == 0
        run.stop()


def test_submit_on_commit_takes_the_request_s_tenant_and_priority(
        qname: str, redis_url: str, wsgi: WebServer) -> None:
    q = mtq.Queue(qname, redis_url)
    with httpx.Client(base_url=wsgi.base, timeout=10) as http:
        default = post(http, f"/q/{qname}/orders", {"item": "tea"}, **{"X-User": "ann"})
        batch = post(http, f"/q/{qname}/orders", {"item": "tea"},
                     **{"X-User": "bob", "X-Mtq-Priority": "batch"})
    for task, fields in ((default, [b"ann", b"i"]), (batch, [b"bob", b"b"])):
        assert q.redis.hmget(q.broker.keys.task(task["id"]), ["tenant", "band"]) == fields


# -- manage.py ------------------------------------------------------------------------------
def test_manage_py_check_reports_unreachable_redis_and_missing_target(
        redis_url: str) -> None:
    ok = manage(project_env(redis_url, MTQ_DJANGO_WORKERS="tests.models:Counter"), "check")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "no issues" in ok.stdout

    t0 = time.monotonic()
    down = manage(project_env(redis_url, MTQ_DJANGO_REDIS_URL=NOWHERE), "check")
    assert down.returncode == 1, down
    assert "(mtq.E001) cannot reach Redis at redis://127.0.0.1:1/0" in down.stderr, down.stderr
    assert "HINT:" in down.stderr and "mtq.E002" not in down.stderr
    assert time.monotonic() - t0 < 20

    name = "no_such_module_" + uuid.uuid4().hex[:6]
    for target, says in ((f"{name}:Model", name), ("tests.models:NoSuchModel", "NoSuchModel")):
        bad = manage(project_env(redis_url, MTQ_DJANGO_WORKERS=target), "check")
        assert bad.returncode == 1, bad
        assert "(mtq.E002)" in bad.stderr and says in bad.stderr, bad.stderr
        assert "mtq.E001" not in bad.stderr

    # no Redis URL at all: the embedded server, started on demand (not by a check);
    # --deploy warns that other hosts cannot reach it
    env = project_env(redis_url)
    del env["MTQ_REDIS_URL"]
    embedded = manage(env, "check", "--deploy", "--tag", "mtq")
    assert embedded.returncode == 0, embedded.stdout + embedded.stderr
    assert "(mtq.W001)" in embedded.stderr and "mtq.E001" not in embedded.stderr


def test_the_checks_and_commands_do_not_import_torch(redis_url: str) -> None:
    code = ("import sys, django; django.setup(); from django.core import management; "
            "management.call_command('check'); management.call_command('mtq_status', '--json'); "
            "import mtq.contrib.django.management.commands.mtq_workers; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=60,
                         env=project_env(redis_url, MTQ_DJANGO_WORKERS="tests.models:Counter",
                                         DJANGO_SETTINGS_MODULE="tests.django_project.settings"))
    assert out.returncode == 0, out.stdout + out.stderr


def test_manage_py_mtq_status(qname: str, redis_url: str) -> None:
    mtq.Queue(qname, redis_url).submit({"n": 1})
    out = manage(project_env(redis_url), "mtq_status", "--json")
    assert out.returncode == 0, out.stderr
    assert qname in json.dumps(json.loads(out.stdout))
    out = manage(project_env(redis_url), "mtq_status", qname)
    assert out.returncode == 0 and qname in out.stdout, out.stdout + out.stderr
    # the project's MTQ["REDIS_URL"] wins over the environment's
    out = manage(project_env(NOWHERE, MTQ_DJANGO_REDIS_URL=redis_url), "mtq_status", "--json")
    assert out.returncode == 0 and qname in out.stdout, out.stderr
    # the command line's over the project's; Django's --settings is manage.py's (NOWHERE
    # refused at once: no retries)
    out = manage(project_env(redis_url, MTQ_REDIS_RETRIES="0"), "mtq_status", "--redis", NOWHERE,
                 "--settings", "tests.django_project.settings")
    assert out.returncode == 5 and "cannot reach Redis" in out.stderr, out
    out = manage(project_env(redis_url), "help", "mtq_workers")
    assert out.returncode == 0 and "--replicas" in out.stdout and "TARGET" in out.stdout, out


def test_manage_py_mtq_workers_serves_the_queue_and_stops_on_sigterm(
        qname: str, redis_url: str, r: redis.Redis, tmp_path: Path) -> None:
    env = project_env(redis_url, MTQ_QUEUE=qname, MTQ_DJANGO_WORKERS="tests.models:Counter")
    log = tmp_path / "workers.log"
    with open(log, "wb") as sink:
        proc = subprocess.Popen([sys.executable, MANAGE, "mtq_workers", "--standby", "0"],
                                cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        wait_for(lambda: list_workers(r, qname) or proc.poll() is not None, 60,
                 f"manage.py mtq_workers registered no worker on {qname}")
        assert proc.poll() is None, log.read_text()
        task = mtq.Queue(qname, redis_url).submit({"n": 4})
        assert task.result(timeout=20)["tokens"] == [0, 1, 2, 3]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    # without a target in the settings nor on the command line, it says what is missing
    out = manage(project_env(redis_url, MTQ_QUEUE=qname), "mtq_workers")
    assert out.returncode == 2 and "TARGET" in out.stderr, out


def test_manage_py_mtq_workers_checks_model_options_before_redis(qname: str) -> None:
    # --set is the click command's (manage.py's own --settings does not take it), and a
    # value the target cannot take is exit 2 before the (unreachable) Redis is waited for
    env = project_env(NOWHERE, MTQ_QUEUE=qname, MTQ_DJANGO_WORKERS="tests.models:Configured",
                      MTQ_REDIS_WAIT_S="60")
    out = manage(env, "mtq_workers", "--set", "model=/m", "--settings",
                 "tests.django_project.settings", "--set", "layers=0", timeout=30)
    assert out.returncode == 2, out
    assert "option 'layers' must be >= 1 and <= 8, got 0" in " ".join(out.stderr.split())
    assert "cannot reach" not in out.stderr, out.stderr
    out = manage(env, "mtq_workers", "--set", "pooling=cls", timeout=30)
    assert out.returncode == 2 and "option 'model' is required" in out.stderr, out
