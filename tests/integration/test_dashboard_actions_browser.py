"""The web dashboard's actions in a real headless Chromium (selenium, Debian's chromium
and chromedriver as in tests/integration/test_browser.py; skipped without them): an
admin signs in with an admin key and pauses a queue served by a real ``mtq workers
start`` supervisor (the flash shows, the registry shows the workers paused), and a
form on a page of another origin that posts to the dashboard is refused (the workers
stay paused). The dashboard is the access rules' app of tests/support/dashboard_access.py
under a real uvicorn; the other origin a plain HTTP server on another port."""

from __future__ import annotations

import http.server
import os
import subprocess
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from mtq.client import apikeys
from tests.support.browser import headless_chromium
from tests.support.paths import PY, ROOT
from tests.support.processes import free_port
from tests.support.supervisors import Sup, wait_workers, workers_of
from tests.support.waits import wait_for

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed "
                                "(pip install -e '.[dev]')")
from selenium.common.exceptions import (  # noqa: E402
    NoSuchElementException,
    StaleElementReferenceException,
)
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

pytestmark = pytest.mark.timeout(120)



def tail(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:] if path.exists() else "(no output)"


@pytest.fixture(scope="module")
def world(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A queue with its supervisor (one Counter worker), the dashboard under uvicorn."""
    tmp = tmp_path_factory.mktemp("dash-browser")
    queue = "dashb-" + uuid.uuid4().hex[:8]
    env = {**os.environ, "MTQ_REDIS_URL": redis_url, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []
    with open(tmp / "supervisor.log", "wb") as out:
        procs.append(subprocess.Popen(
            [PY, "-m", "mtq", "workers", "start", "tests.models:Counter", "--queue", queue,
             "--devices", "cpu", "--replicas", "1", "--standby", "0", "--redis", redis_url],
            env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
    with open(tmp / "dashboard.log", "wb") as out:
        procs.append(subprocess.Popen(
            [PY, "-m", "uvicorn", "--factory", "tests.support.dashboard_access:from_env",
             "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
            env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
    base = f"http://127.0.0.1:{port}"
    sup = Sup(procs[0], tmp / "supervisor.log")
    r = redis.Redis.from_url(redis_url)

    def up() -> bool:
        assert procs[1].poll() is None, tail(tmp / "dashboard.log")
        try:
            return httpx.get(base + "/login", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_for(up, 30, f"the dashboard did not answer on {base}")
        wait_workers(r, queue, 1, sup)
        token, key = apikeys.create(r, "ops-" + uuid.uuid4().hex[:6], admin=True)
        yield {"base": base, "queue": queue, "sup": sup, "r": r, "token": token, "key": key}
    finally:
        r.close()
        for p in procs:
            Sup(p, tmp / "x").kill()


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with headless_chromium(tmp_path_factory.mktemp("chromium")) as driver:
        yield driver


@pytest.fixture(scope="module")
def other_site(world: dict[str, Any]) -> Iterator[str]:
    """A page on another origin (another port) whose form posts to the dashboard."""
    target = f"{world['base']}/queues/{world['queue']}/resume"
    page = (f'<!doctype html><title>elsewhere</title><form id="f" method="post" '
            f'action="{target}"><input type="hidden" name="csrf" value="guess">'
            '<button id="go" type="submit">win a prize</button></form>').encode()

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def shot(driver: Any, name: str) -> None:
    """A screenshot, where MTQ_SCREENSHOTS names a folder (the docs take them there)."""
    folder = os.environ.get("MTQ_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(Path(folder) / name))


def wait_text(driver: Any, element_id: str, part: str, timeout: float = 20) -> str:
    """The text of the element ``element_id`` once it holds ``part`` (the page may be
    replaced meanwhile: a form's answer is a redirect to a new page)."""
    def shown(d: Any) -> str | None:
        text = str(d.find_element(By.ID, element_id).text)
        return text if part in text else None

    return str(WebDriverWait(driver, timeout, ignored_exceptions=(
        NoSuchElementException, StaleElementReferenceException)).until(
            shown, f"#{element_id} holds {part!r}"))


def test_sign_in_and_pause_then_a_cross_site_form_is_refused(
        world: dict[str, Any], browser: Any, other_site: str) -> None:
    queue, r, sup = world["queue"], world["r"], world["sup"]
    browser.get(f"{world['base']}/queues/{queue}")
    wait_text(browser, "who", "read-only")
    browser.find_element(By.ID, "signin").click()
    WebDriverWait(browser, 20).until(lambda d: d.find_elements(By.NAME, "key"))
    browser.find_element(By.NAME, "key").send_keys(world["token"])
    shot(browser, "dashboard-sign-in.png")
    browser.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    wait_text(browser, "flash", "signed in with admin key")
    wait_text(browser, "who", f"admin {world['key'].id}")

    browser.find_element(By.ID, "pause").click()
    wait_text(browser, "flash", "pause: sent to 1 supervisor(s)")
    shot(browser, "dashboard-paused.png")
    wait_workers(r, queue, 1, sup, check=lambda w: w["state"] == "paused")

    # another origin's page posts to the dashboard with the browser's cookies
    browser.get(other_site)
    browser.find_element(By.ID, "go").click()
    WebDriverWait(browser, 20).until(lambda d: "Refused" in d.title)
    body = browser.find_element(By.TAG_NAME, "body").text
    assert "came from another site" in body, body
    # the refusal was answered: the request is over, and the workers stayed paused
    assert all(w["state"] == "paused" for w in workers_of(r, queue, live_only=True))
    browser.get(f"{world['base']}/queues/{queue}")
    browser.find_element(By.ID, "resume").click()
    wait_text(browser, "flash", "resume: sent to 1")
    wait_workers(r, queue, 1, sup, check=lambda w: w["state"] != "paused")
