"""Helpers of the web tests: a real uvicorn process serving ``tests.web_app:app`` (or
gunicorn serving ``tests.flask_app``; both serving the Django project
``tests.django_project``), and
a reader of server-sent events over a real HTTP connection (httpx)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.support.paths import ROOT
from tests.support.processes import free_port
from tests.support.waits import wait_for


@dataclass
class SSE:
    """One event of a stream as a client parses it (or a comment line)."""

    event: str = "message"
    id: str | None = None
    data: str = ""
    retry: int | None = None
    comment: str | None = None
    #: the number of the network read (chunk) that completed it, from 1
    chunk: int = 0

    def json(self) -> Any:
        return json.loads(self.data)


def parse_block(block: str) -> SSE:
    ev = SSE()
    data: list[str] = []
    for line in block.split("\n"):
        if line.startswith(":"):
            ev.comment = line[1:].strip()
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            ev.event = value
        elif name == "id":
            ev.id = value
        elif name == "data":
            data.append(value)
        elif name == "retry":
            ev.retry = int(value)
    ev.data = "\n".join(data)
    return ev


def events(resp: httpx.Response) -> Iterator[SSE]:
    """The events (and comments) of a streaming response, as they arrive."""
    buf = ""
    for n, chunk in enumerate(resp.iter_text(), 1):
        buf += chunk
        while "\n\n" in buf:
            block, buf = buf.split("\n\n", 1)
            ev = parse_block(block)
            ev.chunk = n
            yield ev


@dataclass
class Stream:
    """What one read of a stream got."""

    events: list[SSE] = field(default_factory=list)

    def of(self, kind: str) -> list[SSE]:
        return [e for e in self.events if e.event == kind and e.comment is None]

    def tokens(self) -> list[tuple[int, Any]]:
        return [(int(e.id), e.json()) for e in self.of("token")]  # type: ignore[arg-type]

    @property
    def last(self) -> SSE:
        real = [e for e in self.events if e.comment is None and e.retry is None]
        return real[-1]


def read(http: httpx.Client, path: str, *, until: int | None = None,
         headers: dict[str, str] | None = None) -> Stream:
    """Read an event stream to its end, or (``until``) until the token of that index,
    then close the connection."""
    got = Stream()
    with http.stream("GET", path, headers=headers or {}) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.headers["content-type"].startswith("text/event-stream")
        for ev in events(resp):
            got.events.append(ev)
            if until is not None and ev.event == "token" and int(ev.id or -1) >= until:
                break
    return got


class WebServer:
    """``python -m uvicorn tests.web_app:app`` (or ``app``) on a free loopback port."""

    #: the ASGI application, ``module:attr``
    app = "tests.web_app:app"
    #: more command-line options
    options: tuple[str, ...] = ()

    def __init__(self, redis_url: str, log: Path, **env: str) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.client_name = "mtqweb-" + uuid.uuid4().hex[:10]
        self.redis_url = redis_url
        self.log = log
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.pid = 0

    def start(self) -> None:
        env = dict(os.environ)
        env.update(MTQ_REDIS_URL=self.redis_url, MTQ_WEB_CLIENT_NAME=self.client_name,
                   PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
                   **self.env)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.command(), cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)

        def up() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.command()[2]} exited:\n{self.output()}")
            try:
                r = httpx.get(self.base + "/healthz", timeout=2)
            except httpx.TransportError:
                return False
            self.pid = int(r.json()["pid"])
            return r.status_code == 200

        wait_for(up, 30, f"{self.command()[2]} did not answer on {self.base}")

    def command(self) -> list[str]:
        return [sys.executable, "-m", "uvicorn", self.app, "--host", "127.0.0.1",
                "--port", str(self.port), "--log-level", "warning",
                "--timeout-graceful-shutdown", "2", *self.options]

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


class GunicornServer(WebServer):
    """``gunicorn 'tests.flask_app:create_app()'`` (threaded workers: each open stream
    holds a thread) on a free loopback port."""

    app = "tests.flask_app:create_app()"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "gunicorn", self.app,
                "--bind", f"127.0.0.1:{self.port}", "--worker-class", "gthread",
                "--workers", "1", "--threads", "8", "--graceful-timeout", "2",
                "--log-level", "warning"]


class DjangoWsgiServer(GunicornServer):
    """The Django test project (tests/django_project) under gunicorn, threaded."""

    app = "tests.django_project.wsgi:application"


class DjangoAsgiServer(WebServer):
    """The Django test project under uvicorn (ASGI: its async views)."""

    app = "tests.django_project.asgi:application"
    options = ("--lifespan", "off")  # Django speaks no lifespan protocol
