"""The example chat page (examples/web/chat.html) in a real headless Chromium, driven
by selenium, against each example app under its real server (uvicorn for FastAPI and
Django, gunicorn with two processes for Flask: a reload may reach the other process),
a real redis-server and a real supervisor (``mtq workers
start``) serving TinyGPT: tokens appear as they come, a reload mid-stream resumes
without gap or repeat, a closed tab cancels its task and frees the worker's slot, a
worker killed mid-generation shows ``restarted`` and the full text, and the text is
English words (TinyGPT's shipped trained weights).

The worker serves ``tests.gpt_models:SlowTinyGPT``: the real TinyGPT, one request at
a time, 25 ms a decode step and no stop at EOS, so a generation lasts long enough
to reload or close the page in the middle of it (TinyGPT alone makes ~1000 tokens a
second here).

Debian's ``chromium`` and ``chromium-driver`` (scripts/install-system-deps installs
them); selenium is pointed at them (no browser download). Skipped without them.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

import mtq
from mtq.broker.keys import QueueKeys
from mtq.workers.registry import list_workers
from tests.support.browser import headless_chromium
from tests.support.paths import ROOT
from tests.support.processes import free_port
from tests.support.waits import wait_for

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed "
                                "(pip install -e '.[dev]')")
from selenium.common.exceptions import TimeoutException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

STEP_MS = 25
PROMPT = "Once upon a time"


@dataclass(frozen=True)
class Example:
    """One example app: how to serve it on a port. Each serves the same URLs (GET /,
    POST /chat, GET /chat/<id>/events, cancel on disconnect with a reload grace)."""

    name: str
    command: Callable[[int], list[str]]


EXAMPLES = [
    Example("fastapi", lambda port: [
        sys.executable, "-m", "uvicorn", "examples.web.fastapi_chat:app", "--host",
        "127.0.0.1", "--port", str(port), "--log-level", "warning",
        "--timeout-graceful-shutdown", "2"]),
    Example("flask", lambda port: [
        sys.executable, "-m", "gunicorn", "examples.web.flask_chat:app", "--bind",
        f"127.0.0.1:{port}", "--worker-class", "gthread", "--workers", "2", "--threads",
        "16", "--graceful-timeout", "2", "--log-level", "warning"]),
    Example("django", lambda port: [
        sys.executable, "-m", "uvicorn", "examples.web.django_chat:application", "--host",
        "127.0.0.1", "--port", str(port), "--log-level", "warning", "--lifespan", "off",
        "--timeout-graceful-shutdown", "2"]),
]


def tail(path: Path, n: int = 3000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else "(no output)"


def alive(pid: int) -> bool:
    """The process runs (a killed one not yet reaped is a zombie: not alive)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


# -- fixtures: Redis (conftest), a queue and its supervisor, a server, a browser ---------
@pytest.fixture(scope="module", params=EXAMPLES, ids=[e.name for e in EXAMPLES])
def example(request: pytest.FixtureRequest) -> Example:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def chat_queue(example: Example) -> str:
    """A queue and a supervisor for each example: one that restarted a killed worker
    a moment ago would restart the next one only after its crash backoff."""
    return f"browser-{example.name}-" + uuid.uuid4().hex[:8]


@pytest.fixture(scope="module")
def env(redis_url: str, chat_queue: str) -> dict[str, str]:
    e = dict(os.environ)
    e.pop("MTQ_REFERENCE_WEIGHTS", None)  # the shipped trained weights
    e.update(MTQ_REDIS_URL=redis_url, MTQ_QUEUE=chat_queue,
             MTQ_TEST_STEP_MS=str(STEP_MS), OMP_NUM_THREADS="1",
             PYTHONPATH=os.pathsep.join([str(ROOT), e.get("PYTHONPATH", "")]))
    return e


@pytest.fixture(scope="module")
def supervisor(env: dict[str, str], redis_url: str, chat_queue: str,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """``mtq workers start`` with one TinyGPT worker (it restarts a killed one)."""
    log = tmp_path_factory.mktemp("supervisor") / "supervisor.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mtq", "workers", "start", "tests.gpt_models:SlowTinyGPT",
             "--queue", chat_queue, "--devices", "cpu", "--replicas", "1",
             "--lease-ms", "3000"], env=env, cwd=ROOT, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True)
    r = redis.Redis.from_url(redis_url)
    try:
        wait_for(lambda: proc.poll() is not None or list_workers(r, chat_queue), 60,
                 "the supervisor's TinyGPT worker did not register")
        assert proc.poll() is None, f"the supervisor exited:\n{tail(log)}"
        yield log
    finally:
        r.close()
        stop(proc)


@dataclass
class Served:
    example: Example
    base: str
    log: Path


@pytest.fixture(scope="module")
def server(example: Example, env: dict[str, str], supervisor: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    port = free_port()
    log = tmp_path_factory.mktemp(example.name) / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(example.command(port), env=env, cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert proc.poll() is None, f"{example.name} server exited:\n{tail(log)}"
        try:
            return httpx.get(base + "/", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_for(up, 30, f"the {example.name} example did not answer on {base}")
        yield Served(example, base, log)
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with headless_chromium(tmp_path_factory.mktemp("chromium")) as driver:
        yield driver


@pytest.fixture
def q(redis_url: str, chat_queue: str) -> mtq.Queue:
    return mtq.Queue(chat_queue, redis_url)


# -- the page -------------------------------------------------------------------------------
READ = """
const o = document.getElementById("output");
return {state: o.dataset.state, status: o.dataset.status || null, task: o.dataset.task || null,
        updates: Number(o.dataset.updates), dropped: Number(o.dataset.dropped),
        restarts: Number(o.dataset.restarts), matches: o.dataset.matches || null,
        text: o.textContent, log: document.getElementById("log").textContent};
"""


def page(driver: Any) -> dict[str, Any]:
    """What the page shows (see the comment at the top of chat.html)."""
    return dict(driver.execute_script(READ))


def wait_page(driver: Any, until: Callable[[dict[str, Any]], bool], timeout: float,
              message: str, seen: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Wait until ``until(page)``; every page read is appended to ``seen``."""
    last: dict[str, Any] = {}

    def check(d: Any) -> dict[str, Any] | bool:
        nonlocal last
        last = page(d)
        if seen is not None:
            seen.append(last)
        return last if until(last) else False

    try:
        got: dict[str, Any] = WebDriverWait(driver, timeout, poll_frequency=0.05).until(check)
    except TimeoutException:
        pytest.fail(f"timed out after {timeout}s: {message}; the page: {last}")
    return got


def fresh_page(driver: Any, server: Served) -> None:
    """The chat page with no task remembered (sessionStorage is per tab and origin)."""
    driver.get(server.base + "/")
    driver.execute_script("sessionStorage.clear()")
    driver.get(server.base + "/")
    wait_page(driver, lambda p: p["state"] == "idle", 10, "the page did not load idle")


def ask(driver: Any, max_tokens: int) -> None:
    box = driver.find_element(By.ID, "prompt")
    box.clear()
    box.send_keys(PROMPT)
    n = driver.find_element(By.ID, "max_tokens")
    n.clear()
    n.send_keys(str(max_tokens))
    driver.find_element(By.ID, "send").click()


def streaming(at_least: int) -> Callable[[dict[str, Any]], bool]:
    return lambda p: p["state"] == "streaming" and p["updates"] >= at_least


def ended(p: dict[str, Any]) -> bool:
    return p["state"] in ("done", "error")


def assert_gapless(seen: list[dict[str, Any]], final: str, task: str) -> None:
    """Every text the page showed for ``task`` was a prefix of the final text: no
    token missing (a later one shown first) and none shown twice, at any moment."""
    shown = [p["text"] for p in seen if p["task"] == task]
    bad = [t for t in shown if not final.startswith(t)]
    assert not bad, f"the page showed text that is not a prefix of the result: {bad[:2]!r}"


# -- the tests ------------------------------------------------------------------------------
def test_tokens_appear_progressively_and_the_text_equals_the_result(
        browser: Any, server: Served, q: mtq.Queue) -> None:
    fresh_page(browser, server)
    ask(browser, 80)
    early = wait_page(browser, streaming(3), 30, "no token reached the page")
    seen: list[dict[str, Any]] = []
    end = wait_page(browser, ended, 30, "the stream did not end", seen)
    result = q.task(end["task"]).result(timeout=5)
    assert end["state"] == "done" and end["status"] == "succeeded", end
    assert end["matches"] == "true", "the streamed text differed from the result"
    assert end["text"] == result["text"] and len(result["tokens"]) == 80
    # progressive: the page showed part of the text while the task still ran
    assert 3 <= early["updates"] < end["updates"] == 80, (early["updates"], end["updates"])
    assert result["text"].startswith(early["text"]) and len(early["text"]) < len(end["text"])
    assert end["dropped"] == 0 and end["restarts"] == 0
    assert_gapless(seen, end["text"], end["task"])
    # the page shows words, not bytes: the shipped weights write English
    text = end["text"]
    plain = sum(c.isascii() and (c.isalnum() or c in " \n.,;:!?'\"-()") for c in text)
    assert "\ufffd" not in text and plain >= 0.95 * len(text), text
    assert len(re.findall(r"\b(?:the|and|of|to|a|her|was|in|it|not|be)\b", text)) >= 3, text


def test_a_reload_mid_stream_resumes_without_gap_or_repeat(
        browser: Any, server: Served, q: mtq.Queue) -> None:
    fresh_page(browser, server)
    ask(browser, 160)
    before = wait_page(browser, streaming(20), 30, "the generation did not stream")
    task = before["task"]
    assert q.task(task).status() == "running"
    browser.refresh()
    seen: list[dict[str, Any]] = []
    wait_page(browser, lambda p: p["task"] == task, 10,
              "the reloaded page did not re-attach to its task", seen)
    assert q.task(task).status() == "running", "the task ended before the reload was done"
    end = wait_page(browser, ended, 30, "the reloaded page's stream did not end", seen)
    result = q.task(task).result(timeout=5)  # not cancelled: the page came back in time
    assert end["state"] == "done" and end["matches"] == "true", end
    assert end["text"] == result["text"] and len(result["tokens"]) == 160
    assert end["updates"] == 160 and end["dropped"] == 0, end
    assert result["text"].startswith(before["text"])
    assert_gapless(seen, end["text"], task)
    # the reloaded page showed the text as it went on, not only at the end
    assert any(p["state"] == "streaming" for p in seen if p["task"] == task)


def test_closing_the_tab_cancels_the_task_and_frees_the_worker(
        browser: Any, server: Served, q: mtq.Queue, redis_url: str) -> None:
    first = browser.current_window_handle
    browser.switch_to.new_window("tab")
    try:
        fresh_page(browser, server)
        ask(browser, 400)  # 10 s of generation at 25 ms a step
        at = wait_page(browser, streaming(5), 30, "the generation did not stream")
        waiting = q.submit({"prompt": "next", "max_tokens": 8}, stream="someone-else")
        assert waiting.status() == "queued", "the one slot should be taken"
    finally:
        browser.close()  # the tab, and with it its EventSource
        browser.switch_to.window(first)
    closed = time.monotonic()
    task = q.task(at["task"])
    wait_for(lambda: task.status() == "cancelled", 15,
             "the task of the closed tab was not cancelled")
    cancelled_after = time.monotonic() - closed
    # the slot it held goes to the task that waited
    assert len(waiting.result(timeout=15)["tokens"]) == 8
    r = redis.Redis.from_url(redis_url)
    try:
        generated = r.llen(QueueKeys(q.name).out(task.id))
    finally:
        r.close()
    # well before its end: the 2 s reload grace and a step, not the 400 tokens
    assert cancelled_after < 8, cancelled_after
    assert generated < 300, generated
    assert task.info().cancel_requested


def test_a_worker_killed_mid_generation_shows_restarted_and_the_full_text(
        browser: Any, server: Served, q: mtq.Queue, redis_url: str, chat_queue: str,
        supervisor: Path) -> None:
    r = redis.Redis.from_url(redis_url)
    try:
        def live() -> list[dict[str, Any]]:
            return [w for w in list_workers(r, chat_queue) if alive(int(w["pid"]))]

        (worker,) = wait_for(lambda: len(live()) == 1 and live(), 60,
                             f"not one live worker: {list_workers(r, chat_queue)}")
        fresh_page(browser, server)
        ask(browser, 160)
        before = wait_page(browser, streaming(20), 30, "the generation did not stream")
        os.kill(int(worker["pid"]), signal.SIGKILL)
        seen: list[dict[str, Any]] = []
        end = wait_page(browser, ended, 60, "the stream did not end after the worker "
                        "was killed (the supervisor restarts it)", seen)
    finally:
        r.close()
    result = q.task(end["task"]).result(timeout=5)
    assert end["state"] == "done" and end["matches"] == "true", end
    assert end["restarts"] == 1 and "restarted" in end["log"], end
    assert end["text"] == result["text"] and len(result["tokens"]) == 160
    assert end["updates"] == 160 and end["dropped"] == 0, end
    assert result["text"].startswith(before["text"])
    assert_gapless(seen, end["text"], end["task"])
    assert q.task(end["task"]).info().deliveries == 2
