"""The web dashboard in a real headless Chromium (selenium, the harness of
test_browser.py: Debian's chromium and chromedriver, skipped without them), against
real queues, workers and a real uvicorn: every page loads, figures change on the
page without a reload, markup from Redis shows as text and never runs, and the
pages' screenshots are saved (always to the test's tmp dir; to docs/img/ as well with
``MTQ_SCREENSHOTS=1``, which is how docs/dashboard.md's images are made)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import mtq
from tests.support.browser import headless_chromium
from tests.support.dashboard import EVIL, EVIL_STREAM, STORY, Site, site, traffic
from tests.support.paths import ROOT
from tests.support.waits import wait_for

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed "
                                "(pip install -e '.[dev]')")
from selenium.common.exceptions import NoAlertPresentException, TimeoutException  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

pytestmark = pytest.mark.timeout(120)

DOCS_IMG = ROOT / "docs" / "img"
SCREENSHOTS = os.environ.get("MTQ_SCREENSHOTS") == "1"
#: chart points to wait for before a screenshot (more for the docs' images)
POINTS = 40 if SCREENSHOTS else 4


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with headless_chromium(tmp_path_factory.mktemp("chromium"), "--window-size=1280,900",
                           "--hide-scrollbars") as driver:
        yield driver


@pytest.fixture(scope="module")
def s(redis_url: str) -> Iterator[Site]:
    with site(redis_url, refresh_s=0.5) as world:
        yield world


def until(driver: Any, script: str, timeout: float, message: str, *args: Any,
          ok: Any = bool) -> Any:
    """Wait until ``ok`` of what the page's ``script`` returns holds; that value."""
    def check(d: Any) -> Any:
        value = d.execute_script(script, *args)
        return value if ok(value) else False

    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.05).until(check)
    except TimeoutException:
        pytest.fail(f"timed out after {timeout}s: {message}")


def no_alert(driver: Any) -> None:
    try:
        text = driver.switch_to.alert.text
    except NoAlertPresentException:
        return
    pytest.fail(f"a script from Redis ran: alert({text!r})")


def shoot(driver: Any, name: str, tmp: Path) -> None:
    """Save a screenshot of the page: to the test's tmp dir, and with MTQ_SCREENSHOTS=1
    to docs/img/dashboard-NAME.png."""
    driver.execute_script("window.scrollTo(0, 0)")
    png = driver.get_screenshot_as_png()
    (tmp / f"dashboard-{name}.png").write_bytes(png)
    if SCREENSHOTS:
        DOCS_IMG.mkdir(parents=True, exist_ok=True)
        (DOCS_IMG / f"dashboard-{name}.png").write_bytes(png)


WAITING = """
const row = document.querySelector('tr[data-queue="' + arguments[0] + '"] td.waiting');
return row ? Number(row.textContent.replace(/,/g, '')) : null;
"""


def test_every_page_loads_updates_live_and_shows_markup_as_text(
        browser: Any, s: Site, redis_url: str, tmp_path: Path) -> None:
    # the overview: live, a figure that changes without a reload
    browser.get(s.base + "/")
    until(browser, "return document.getElementById('live-state').textContent === 'live'", 10,
          "the overview's live stream did not open")
    browser.execute_script("window.notReloaded = true")
    before = browser.execute_script(WAITING, s.sched)
    added = mtq.Queue(s.sched, redis_url).submit_many([{"more": i} for i in range(3)],
                                                     tenant="carol")
    until(browser, WAITING, 10, f"the page did not show {before + 3} waiting", s.sched,
          ok=lambda n: n == before + 3)
    assert browser.execute_script("return window.notReloaded === true"), "the page reloaded"
    body = browser.find_element("tag name", "body").text
    assert EVIL in body and EVIL_STREAM not in body  # tenants and workers: text
    no_alert(browser)
    with traffic(redis_url, s.served):
        # some minutes of charts are not to be had in a test: a few seconds of traffic
        until(browser, "return document.querySelectorAll('svg.spark path.rate').length >= 3 "
              "&& [...document.querySelectorAll('svg.spark path.rate')].some("
              "p => p.getAttribute('d').split('L').length > arguments[0])", 15 + POINTS,
              "the charts did not draw", POINTS)
        shoot(browser, "overview", tmp_path)

        browser.get(s.base + f"/queues/{s.served}")
        until(browser, "return document.getElementById('live-state').textContent === 'live'",
              10, "the queue page's live stream did not open")
        until(browser, "return [...document.querySelectorAll('svg.big path.rate')].some("
              "p => p.getAttribute('d').split('L').length > arguments[0])", 15,
              "the queue's throughput chart did not draw", POINTS)
        text = browser.find_element("tag name", "body").text
        assert "Dead letters (1)" in text and f"{EVIL} went wrong" in text
        no_alert(browser)
        shoot(browser, "queue", tmp_path)

    browser.get(s.base + f"/queues/{s.sched}")
    text = browser.find_element("tag name", "body").text
    assert re.search(rf"{re.escape(EVIL_STREAM)}\s+4", text), text  # a busiest stream
    no_alert(browser)
    for t in added:
        t.cancel()

    # the streaming task: its tokens arrive on the page, its payload is text
    assert s.streaming is not None
    browser.get(s.base + f"/tasks/{s.streaming.id}")
    first = until(browser, "const o = document.getElementById('tokens');"
                  "return Number(o.dataset.count || 0) >= 5 && Number(o.dataset.count)", 15,
                  "no token reached the task page")
    until(browser, f"return Number(document.getElementById('tokens').dataset.count) > {first}",
          10, "the tokens did not keep coming")
    tokens = browser.find_element("id", "tokens").text
    assert tokens.startswith(" ".join(STORY[:5])), tokens
    assert EVIL in browser.find_element("id", "payload").text
    no_alert(browser)
    shoot(browser, "task", tmp_path)

    # the dead task: error and traceback as text
    browser.get(s.base + f"/tasks/{s.dead}")
    # the pages left closed their streams (a page kept for the back button would hold its
    # connections, and the browser allows six per host: the dashboard would hang)
    wait_for(lambda: s.dashboard.sampler.viewers == 0, 10,
             f"{s.dashboard.sampler.viewers} live streams of pages left are still open")
    assert f"ValueError: {EVIL} went wrong" in browser.find_element("id", "toutcome").text
    no_alert(browser)
    assert not browser.execute_script("return document.querySelectorAll('main script, "
                                      "main b').length"), "markup from Redis became elements"
    for name in ("overview", "queue", "task"):
        assert (tmp_path / f"dashboard-{name}.png").stat().st_size > 10_000


def test_an_admin_signs_in_from_the_header_and_cancels_a_task(browser: Any, s: Site,
                                                              redis_url: str) -> None:
    from mtq.client import apikeys

    token, key = apikeys.create(s.redis, "ops", admin=True, name="browser test")
    waiting = mtq.Queue(s.sched, redis_url).submit({"to": "cancel"}, tenant="ops")
    try:
        browser.delete_all_cookies()
        browser.get(s.base + f"/tasks/{waiting.id}")
        assert "Sign in with an admin key to cancel this task" in \
            browser.find_element("tag name", "body").text
        browser.find_element("css selector", "form.signin input[name=key]").send_keys(token)
        browser.find_element("css selector", "form.signin button").click()
        until(browser, "return document.querySelector('.auth .who')?.textContent", 10,
              "the header did not show the admin", ok=lambda t: t == f"admin {key.id}")
        browser.find_element("css selector", "button.act-cancel").click()
        # (the sign-in's flash stays until the cancel's page replaces it)
        until(browser, "return document.getElementById('flash')?.textContent", 10,
              "no flash naming the task after the cancel",
              ok=lambda t: bool(t) and waiting.id in t)
        assert waiting.status() == "cancelled"
        until(browser, "return document.querySelector('#tstatus .status').textContent", 5,
              "the page did not show the task cancelled", ok=lambda t: "cancelled" in t)
        no_alert(browser)
    finally:
        apikeys.revoke(s.redis, key.id)
        browser.delete_all_cookies()
