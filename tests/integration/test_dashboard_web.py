"""The web dashboard (mtq.dashboard.web) against a real redis-server, real workers in
this process and a real uvicorn: every page with real data, the live sections over
SSE, one snapshot per refresh whatever the number of viewers, markup from Redis
escaped everywhere, capped previews, 404s, Redis going away and coming back, and the
``mtq dashboard --web`` command and the ``/dashboard`` mount of ``mtq serve``."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from html import unescape
from pathlib import Path

import httpx
import pytest
import redis

import mtq
from mtq.dashboard.web.app import create_dashboard
from mtq.dashboard.web.reads import PREVIEW_CHARS
from tests.support.dashboard import EVIL, EVIL_STREAM, STORY, Live, Site, Uvicorn, site
from tests.support.paths import ROOT
from tests.support.processes import free_port
from tests.support.servers import RedisServer
from tests.support.waits import wait_for

pytestmark = pytest.mark.timeout(90)

ESCAPED = "&lt;script&gt;alert(1)&lt;/script&gt;&lt;b&gt;bold&lt;/b&gt;"


@pytest.fixture(scope="module")
def s(redis_url: str) -> Iterator[Site]:
    with site(redis_url, refresh_s=0.2) as world:
        yield world


@pytest.fixture(scope="module")
def http(s: Site) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=s.base, timeout=15) as c:
        yield c


def pages(s: Site) -> list[str]:
    assert s.streaming is not None
    return ["/", f"/queues/{s.served}", f"/queues/{s.sched}", f"/queues/{s.gen}",
            f"/tasks/{s.done[0]}", f"/tasks/{s.dead}", f"/tasks/{s.big}",
            f"/tasks/{s.streaming.id}"]


def text_of(html: str) -> str:
    """What a reader sees: the markup's text, entities resolved, whitespace collapsed."""
    return " ".join(unescape(re.sub(r"<[^>]+>", " ", html)).split())


def assert_no_markup_from_redis(html: str, where: str) -> None:
    assert "<script>alert" not in html and "<b>bold</b>" not in html, where
    assert "<script>alert(2)" not in html, where


# -- pages ------------------------------------------------------------------------------
def test_the_overview_shows_queues_tenants_workers_and_failures(s: Site, http: httpx.Client
                                                                  ) -> None:
    r = http.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    seen = text_of(r.text)
    for q in (s.served, s.sched, s.gen):
        assert f'href="/queues/{q}"' in r.text
    # the scheduled queue's tenants and bands, its markup tenant as text
    assert "acme batch 4" in seen and "bob interactive 2" in seen and "bob standard 1" in seen
    assert f"{EVIL} standard 3" in seen
    # workers: host, device, state, batch sizes, model and engine
    assert re.search(rf"{re.escape(s.gen)} cpu \u2013 (running|idle) \d+ / \S+ storyteller/\S+ loaded", seen), seen
    # the dead-lettered task among the recent failures, its error as text
    assert f'/tasks/{s.dead}?queue={s.served}' in r.text
    assert f"dead ValueError: {EVIL} went wrong" in seen
    # a chart per queue (server-rendered SVG)
    assert r.text.count('<svg class="spark"') >= 3
    assert_no_markup_from_redis(r.text, "/")


def test_a_queue_page_shows_charts_streams_waits_failures_and_dead_letters(
        s: Site, http: httpx.Client) -> None:
    r = http.get(f"/queues/{s.served}")
    assert r.status_code == 200
    seen = text_of(r.text)
    assert "dead 1" in seen and "succeeded 4" in seen
    assert r.text.count('<svg class="big"') == 3
    assert "throughput (tasks/s)" in seen and "latency, submit to finish (ms)" in seen
    assert f'href="/tasks/{s.dead}?queue={s.served}"' in r.text
    assert "Dead letters (1)" in seen and f"{EVIL} went wrong" in seen
    # read-only: no action form, a sign-in form that posts to login with csrf and next
    assert 'action="/login"' in r.text and 'name="csrf"' in r.text
    assert f'name="next" value="/queues/{s.served}"' in r.text
    assert "/pause" not in r.text and "/dead/retry" not in r.text
    assert "Sign in with an admin key to retry or purge dead letters" in seen

    r = http.get(f"/queues/{s.sched}")
    seen = text_of(r.text)
    # the busiest streams and the longest waits: acme's 4 tasks in the markup stream
    # first, then user-1's; the oldest waiting tasks first
    assert f"Busiest streams stream waiting busy {EVIL_STREAM} 4 user-1 1" in seen
    waits = re.findall(r'href="/tasks/([\w-]+)\?queue=', r.text.split("Longest waits")[1])
    assert len(waits) >= 3
    assert "acme batch" in seen and "bob interactive" in seen
    assert_no_markup_from_redis(r.text, "queue page")


def test_task_pages_show_fields_trace_previews_and_the_live_tokens(
        s: Site, http: httpx.Client) -> None:
    r = http.get(f"/tasks/{s.done[0]}")
    assert r.status_code == 200
    seen = text_of(r.text)
    assert "status succeeded" in seen and f"stream {EVIL_STREAM}" in seen
    assert '<svg class="timeline"' in r.text
    assert re.search(r"queued \+0 ms.*started \+\d.*succeeded \+\d", seen), seen
    assert json.dumps({"text": EVIL, "i": 0}, indent=2) in unescape(r.text)  # the payload
    assert "Result" in seen and '"echo"' in unescape(r.text)

    r = http.get(f"/tasks/{s.dead}")
    seen = text_of(r.text)
    assert "status dead" in seen and f"Error ValueError: {EVIL} went wrong" in seen
    assert "Traceback Traceback (most recent call last)" in seen
    assert_no_markup_from_redis(r.text, "dead task")

    assert s.streaming is not None
    r = http.get(f"/tasks/{s.streaming.id}")
    assert 'id="tokens"' in r.text
    stream = re.search(r'data-stream="([^"]+)"', r.text)
    assert stream is not None
    # the page's EventSource route: the task's tokens as they come
    got: list[str] = []
    with http.stream("GET", unescape(stream.group(1))) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line.startswith("data: ") and len(got) < 5:
                got.append(json.loads(line[6:]))
            if len(got) == 5:
                break
    assert got == [w + " " for w in STORY[:5]], got


def test_previews_are_capped_and_say_how_much_is_left(s: Site, http: httpx.Client) -> None:
    r = http.get(f"/tasks/{s.big}")
    payload = json.dumps({"text": "x" * 9000, "big": 9000}, indent=2)
    result = json.dumps({"echo": "x" * 9000, "big": "y" * 9000}, indent=2)
    for text in (payload, result):
        assert f"… {len(text) - PREVIEW_CHARS:,} more bytes" in r.text
    shown = re.findall(r'<pre class="preview">(.*?)</pre>', r.text, re.S)
    assert [len(unescape(p)) for p in shown] == [PREVIEW_CHARS, PREVIEW_CHARS]
    assert "x" * 9000 not in r.text


def test_unknown_queues_tasks_and_pages_are_404_pages_that_say_what_to_do(
        http: httpx.Client) -> None:
    for path, says in [("/queues/no-such-queue", "no queue named 'no-such-queue'"),
                       ("/queues/bad%20name", "no queue named 'bad name'"),
                       ("/tasks/no-such-task", "no task 'no-such-task'"),
                       ("/tasks/bad!id", "no task 'bad!id'"),
                       ("/nothing/here", "nothing at /nothing/here")]:
        r = http.get(path)
        assert r.status_code == 404, path
        assert r.headers["content-type"].startswith("text/html")
        seen = text_of(r.text)
        assert says in seen, (path, seen)
        assert "Back to the overview" in seen
    assert "Queues appear once a task is submitted" in text_of(http.get("/queues/x").text)


def test_every_answer_forbids_inline_scripts_and_framing(s: Site, http: httpx.Client) -> None:
    # pages, a 404, the static files, a refusal and a live stream alike
    answers = [http.get(p) for p in ("/", f"/queues/{s.served}", "/nothing/here",
                                     "/static/dashboard.js", "/login")]
    answers.append(http.post(f"/queues/{s.served}/pause", data={}))
    with http.stream("GET", "/events") as live:
        answers.append(live)
    for r in answers:
        where = f"{r.request.method} {r.request.url.path} ({r.status_code})"
        csp = r.headers.get("content-security-policy", "")
        assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp, where
        assert "unsafe-inline" not in csp.split("script-src")[1].split(";")[0], where
        assert r.headers.get("x-frame-options") == "DENY", where
        assert r.headers.get("x-content-type-options") == "nosniff", where
    assert answers[-2].status_code in (401, 403)


def test_a_dead_letter_page_past_the_last_shows_the_last(s: Site, http: httpx.Client) -> None:
    # (it showed "none" under "Dead letters (1)"; a page number past Redis's range: a 500)
    for page in ("7", "99999999999999999999"):
        r = http.get(f"/queues/{s.served}?page={page}")
        assert r.status_code == 200, (page, r.text[-500:])
        assert f'href="/tasks/{s.dead}?queue={s.served}"' in r.text.split('id="dead"')[1]


def test_the_live_stream_of_a_task_there_is_not_ends(s: Site) -> None:
    # (it sent keep-alives for ever, and looked for the task in every queue each refresh)
    for path in ("/tasks/no-such-task/events", f"/tasks/no-such-task/events?queue={s.gen}",
                 "/tasks/bad!id/events"):
        live = Live(s.base, path)
        try:
            assert live.ended.wait(10), f"{path}: the stream did not end"
            assert live.events[-1] == "end" and not live.fragments, (path, live.events)
        finally:
            live.close()


def test_markup_from_redis_is_escaped_in_every_page_and_fragment(s: Site, http: httpx.Client
                                                                 ) -> None:
    for path in pages(s):
        r = http.get(path)
        assert r.status_code == 200, path
        assert_no_markup_from_redis(r.text, path)
    assert ESCAPED in http.get("/").text and ESCAPED in http.get(f"/tasks/{s.dead}").text
    lives = [Live(s.base, p) for p in ("/events", f"/queues/{s.sched}/events",
                                       f"/queues/{s.served}/events",
                                       f"/tasks/{s.dead}/events")]
    try:
        wait_for(lambda: all(x.fragments.get("tenants") for x in lives[:2]), 10,
                 "the live sections did not come")
        wait_for(lambda: lives[3].ended.is_set(), 10, "an ended task's stream did not end")
        for x in lives:
            for section, htmls in x.fragments.items():
                for html in htmls:
                    assert_no_markup_from_redis(html, section)
        assert ESCAPED in lives[0].latest("workers") and ESCAPED in lives[0].latest("tenants")
        assert ESCAPED in lives[2].latest("failures")
        assert f"{EVIL} went wrong" in text_of(lives[3].latest("toutcome"))
    finally:
        for x in lives:
            x.close()


# -- live --------------------------------------------------------------------------------
def waiting_in(html: str, queue: str) -> int | None:
    m = re.search(rf'data-queue="{re.escape(queue)}">.*?<td class="waiting">([\d,]+)</td>',
                  html, re.S)
    return int(m.group(1).replace(",", "")) if m else None


def test_sse_sends_the_sections_that_changed(s: Site, redis_url: str) -> None:
    overview, page = Live(s.base, "/events"), Live(s.base, f"/queues/{s.sched}/events")
    try:
        wait_for(lambda: waiting_in(overview.latest("queues"), s.sched) is not None, 10,
                 "the overview's queues section did not come")
        before = waiting_in(overview.latest("queues"), s.sched)
        assert before is not None
        tasks = mtq.Queue(s.sched, redis_url).submit_many(
            [{"more": i} for i in range(5)], tenant="carol")
        wait_for(lambda: waiting_in(overview.latest("queues"), s.sched) == before + 5, 10,
                 f"the overview did not show {before + 5} waiting")
        wait_for(lambda: "carol standard 5" in text_of(page.latest("tenants")), 10,
                 "the queue page's tenants did not show carol's 5 tasks")
        assert f"waiting {before + 5}" in text_of(page.latest("qfigures"))
        for t in tasks:
            t.cancel()
        wait_for(lambda: waiting_in(overview.latest("queues"), s.sched) == before, 10,
                 "the overview did not go back after the cancels")
        # only what changed is sent: the tenants section came a few times, not per refresh
        assert overview.events.count("fragment") < 8 * len(overview.fragments["summary"])
    finally:
        overview.close()
        page.close()


def test_a_task_page_follows_its_task_to_the_end(s: Site, redis_url: str) -> None:
    t = mtq.Queue(s.gen, redis_url).submit({"n": 30, "step_ms": 20})
    live = Live(s.base, f"/tasks/{t.id}/events?queue={s.gen}")
    try:
        wait_for(live.ended.is_set, 20, "the task's live stream did not end with the task")
        assert live.events[-1] == "end"
        assert "status succeeded" in text_of(live.latest("tstatus"))
        assert "succeeded +" in text_of(live.latest("ttrace"))
    finally:
        live.close()


def test_a_task_pages_live_sections_do_not_read_its_payload(s: Site, redis_url: str) -> None:
    """The payload (up to max_payload_bytes) is on the page, not in its live sections:
    their refreshes must not read and decode it again each time."""
    t = mtq.Queue(s.sched, redis_url).submit({"big": "p" * 100_000}, tenant="ops")
    watcher = redis.Redis.from_url(redis_url)
    seen: list[str] = []
    try:
        with watcher.monitor() as m:
            live = Live(s.base, f"/tasks/{t.id}/events?queue={s.sched}")
            try:
                version = s.dashboard.sampler.version
                wait_for(lambda: s.dashboard.sampler.version >= version + 3, 10,
                         "no refreshes")
                wait_for(lambda: live.fragments.get("tstatus"), 10, "no live sections")
                deadline = time.monotonic() + 1.0
                for cmd in m.listen():
                    seen.append(str(cmd["command"]))
                    if time.monotonic() > deadline:
                        break
            finally:
                live.close()
    finally:
        watcher.close()
        t.cancel()
    reads = [c for c in seen if c.startswith("HMGET") and t.id in c]
    assert reads, "the live sections read nothing of the task"
    assert not [c for c in reads if "payload" in c], reads[:3]


def test_one_snapshot_per_refresh_whatever_the_number_of_viewers(s: Site, http: httpx.Client
                                                                  ) -> None:
    sampler = s.dashboard.sampler
    paths = ["/events"] * 6 + [f"/queues/{s.sched}/events"] * 6
    lives = [Live(s.base, p) for p in paths]
    try:
        wait_for(lambda: sampler.viewers == len(paths), 20,
                 f"the streams did not open: {sampler.viewers} of {len(paths)}")
        reads, t0 = sampler.reads, time.monotonic()
        for _ in range(10):
            assert http.get("/").status_code == 200
            assert http.get(f"/queues/{s.sched}").status_code == 200
        version = sampler.version
        wait_for(lambda: sampler.version >= version + 10, 20, "the sampler stopped")
        refreshes = (time.monotonic() - t0) / sampler.refresh_s
        taken = sampler.reads - reads
        # one per refresh (its own clock: at most one more), not one per viewer or page
        assert 10 <= taken <= refreshes + 1, (taken, refreshes)
        # and every viewer got the refreshes (the summary's clock changes every second)
        wait_for(lambda: all(x.fragments.get("banner") for x in lives), 20,
                 "a viewer got nothing")
    finally:
        for x in lives:
            x.close()
    wait_for(lambda: sampler.viewers == 0, 20,
             f"closed streams were not ended: {sampler.viewers} open")


# -- Redis going away, shutdown ---------------------------------------------------------
def test_redis_unreachable_shows_a_banner_and_the_sampler_keeps_going(tmp_path: Path) -> None:
    server = RedisServer(tmp_path, appendonly=True)  # keeps its data across the restart
    server.start()
    client = redis.Redis.from_url(server.url)
    mtq.Queue("kept", client=client).submit({"i": 1})
    app = create_dashboard(client=client, refresh_s=0.2)
    try:
        with Uvicorn(app) as web, httpx.Client(base_url=web.base, timeout=10) as http:
            assert "Redis unreachable" not in http.get("/").text
            live = Live(web.base, "/events")
            server.stop()
            wait_for(lambda: "Redis unreachable" in live.latest("banner"), 10,
                     "no banner in the live stream")
            r = http.get("/")
            assert r.status_code == 200 and "Redis unreachable; retrying every 0.2 s" in r.text
            assert "showing the figures of" in r.text and 'href="/queues/kept"' in r.text
            r = http.get("/queues/kept")
            assert r.status_code == 503 and "Redis unreachable" in r.text
            r = http.get("/tasks/t-1/stream")  # a task page's EventSource: 503, not 500
            assert r.status_code == 503 and "cannot reach Redis" in r.json()["detail"]
            reads = app.state.dashboard.sampler.reads
            wait_for(lambda: app.state.dashboard.sampler.reads >= reads + 3, 10,
                     "the sampler stopped trying")
            server.start()
            wait_for(lambda: live.latest("banner").count("<p") == 0, 15,
                     "the banner did not go once Redis was back")
            assert http.get("/queues/kept").status_code == 200
            live.close()
    finally:
        client.close()
        server.stop()


def test_streams_end_when_the_dashboard_stops(redis_url: str) -> None:
    app = create_dashboard(client=redis.Redis.from_url(redis_url), refresh_s=0.2)
    with Uvicorn(app) as web:
        live = Live(web.base, "/events")
        wait_for(lambda: live.fragments.get("queues"), 10, "no first fragments")
        app.state.dashboard.sampler.stop_soon()
        assert live.ended.wait(5), "the stream did not end"
        assert live.events[-1] == "end"
        live.close()


@contextmanager
def command(args: list[str], env: dict[str, str], log: Path, probe: str
            ) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """``mtq ARGS --port P`` running until ``probe`` answers 200; killed on the way out."""
    port = free_port()
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "mtq", *args, "--port", str(port)],
                                env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert proc.poll() is None, log.read_text()
        try:
            return httpx.get(base + probe, timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_for(up, 20, f"mtq {args[0]} did not answer on {base}{probe}")
        yield proc, base
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


def stop_with_open_streams(s: Site, proc: subprocess.Popen[bytes], root: str, log: Path
                           ) -> None:
    """SIGTERM to the server of the dashboard at ``root`` with a live stream and a task's
    token stream open: both end at once and it exits 0."""
    assert s.streaming is not None
    live = Live(root, "events")
    tokens = Live(root, f"tasks/{s.streaming.id}/stream?queue={s.gen}")
    wait_for(lambda: live.fragments.get("queues") and "token" in tokens.events, 10,
             "no live fragments or tokens")
    stopping = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert live.ended.wait(5), "the live stream did not end at shutdown"
    assert live.events[-1] == "end"
    assert tokens.ended.wait(5), "the task's token stream did not end at shutdown"
    assert proc.wait(5) == 0, log.read_text()
    # at once, not after uvicorn's graceful timeout (5 s)
    assert time.monotonic() - stopping < 3, log.read_text()
    live.close()
    tokens.close()
    assert s.streaming.status() == "running"  # a viewer leaving cancels nothing


def test_the_web_command_serves_and_stops_cleanly(s: Site, subprocess_env: dict[str, str],
                                                  tmp_path: Path) -> None:
    log = tmp_path / "web.log"
    with command(["dashboard", "--web", "--refresh", "0.2"], subprocess_env, log, "/") as (
            proc, base):
        assert s.served in httpx.get(base + "/").text
        stop_with_open_streams(s, proc, base + "/", log)
    redis_port = s.redis.connection_pool.connection_kwargs["port"]
    assert f"web dashboard of redis://127.0.0.1:{redis_port}/0 at http://127.0.0.1:" in \
        log.read_text()
    bad = subprocess.run([sys.executable, "-m", "mtq", "dashboard", "--web", "--once"],
                         env=subprocess_env, cwd=ROOT, capture_output=True, text=True,
                         timeout=30)
    assert bad.returncode == 2 and "terminal dashboard" in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "mtq", "dashboard", "--web", "--origin",
                          "ops.example.com/x"], env=subprocess_env, cwd=ROOT,
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "give the scheme and host the browser sees" in bad.stderr


def test_beyond_loopback_previews_are_for_admins_only(s: Site, subprocess_env: dict[str, str],
                                                      tmp_path: Path) -> None:
    log = tmp_path / "web.log"
    with command(["dashboard", "--web", "--host", "0.0.0.0"], subprocess_env, log, "/") as (
            _, base), httpx.Client(base_url=base, timeout=10) as http:
        r = http.get(f"/tasks/{s.done[0]}")
        assert r.status_code == 200 and "status succeeded" in text_of(r.text)
        assert '"echo"' not in r.text and '"text"' not in unescape(r.text)
        assert "shown to signed-in admins only" in r.text
        assert s.streaming is not None
        assert http.get(f"/tasks/{s.streaming.id}/stream").status_code == 403
        # the figures, names and errors are still there
        assert f"{EVIL} went wrong" in text_of(http.get(f"/tasks/{s.dead}").text)
    said = " ".join(log.read_text().split())
    assert "listening on 0.0.0.0, beyond loopback" in said
    assert "payloads, results, tokens and tracebacks are shown to signed-in admins only" in said


def test_mtq_serve_mounts_the_dashboard_at_dashboard(s: Site, subprocess_env: dict[str, str],
                                                      tmp_path: Path) -> None:
    with command(["serve"], subprocess_env, tmp_path / "serve.log", "/v1/models") as (
            proc, base), httpx.Client(base_url=base, timeout=10) as http:
        r = http.get("/dashboard/")
        assert r.status_code == 200 and f'href="/dashboard/queues/{s.served}"' in r.text
        assert 'href="/dashboard/static/dashboard.css"' in r.text
        assert 'data-live="/dashboard/events"' in r.text
        assert http.get("/dashboard/static/dashboard.js").status_code == 200
        r = http.get(f"/dashboard/tasks/{s.dead}")
        assert f'href="/dashboard/queues/{s.served}"' in r.text
        assert http.get("/dashboard/queues/nope").status_code == 404
        live = Live(base, "/dashboard/events")
        wait_for(lambda: live.fragments.get("queues"), 10, "no live fragments when mounted")
        assert f'href="/dashboard/queues/{s.served}"' in live.latest("queues")
        live.close()
        assert http.get("/v1/models").status_code == 200  # the gateway still answers


def test_a_tasks_stream_asked_first_under_mtq_serve_leaves_the_gateway_serving(
        s: Site, subprocess_env: dict[str, str], tmp_path: Path) -> None:
    """Under ``mtq serve`` the mounted dashboard's lifespan never runs: a task's token
    stream asked before any page must not stall the event loop (it spun at 100 % CPU
    waiting for a sampler that had never started, and the gateway answered nothing)."""
    assert s.streaming is not None
    with command(["serve"], subprocess_env, tmp_path / "serve.log", "/v1/models") as (
            proc, base):
        tokens = Live(base, f"/dashboard/tasks/{s.streaming.id}/stream?queue={s.gen}")
        try:
            wait_for(lambda: "token" in tokens.events, 10, "no tokens from the task's stream")
            assert httpx.get(base + "/v1/models", timeout=5).status_code == 200
            assert httpx.get(base + "/dashboard/", timeout=5).status_code == 200
        finally:
            tokens.close()


def test_mtq_serve_ends_the_dashboards_streams_at_once_on_sigterm(
        s: Site, subprocess_env: dict[str, str], tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    with command(["serve"], subprocess_env, log, "/v1/models") as (proc, base):
        assert httpx.get(base + "/dashboard/", timeout=10).status_code == 200
        stop_with_open_streams(s, proc, base + "/dashboard/", log)


def test_mtq_serve_takes_the_dashboards_public_origin(
        s: Site, subprocess_env: dict[str, str], tmp_path: Path) -> None:
    """Behind a proxy that changes the Host header the dashboard's actions need its
    public origin; under ``mtq serve`` there was no way to give it (every sign-in and
    action was refused as cross-site, the refusal naming a flag of another command)."""
    from mtq.client import apikeys

    public = "http://ops.example.com:8080"
    token, key = apikeys.create(s.redis, "ops", admin=True)
    try:
        with command(["serve", "--origin", public], subprocess_env,
                     tmp_path / "serve.log", "/v1/models") as (_, base), \
                httpx.Client(base_url=base, timeout=10) as browser:
            page = browser.get("/dashboard/login").text
            csrf = unescape(re.findall(r'name="csrf" value="([^"]+)"', page)[0])
            form = {"key": token, "csrf": csrf, "next": "/"}
            r = browser.post("/dashboard/login", data=form, headers={"Origin": base})
            assert r.status_code == 403, r.text  # the address it listens on is not it
            r = browser.post("/dashboard/login", data=form, headers={"Origin": public})
            assert r.status_code == 303, r.text
            assert r.headers["location"].startswith("/dashboard/?flash=")
    finally:
        apikeys.revoke(s.redis, key.id)
    bad = subprocess.run([sys.executable, "-m", "mtq", "serve", "--origin", "ops.example.com/x"],
                         env=subprocess_env, cwd=ROOT, capture_output=True, text=True,
                         timeout=30)
    assert bad.returncode == 2 and "give the scheme and host the browser sees" in bad.stderr


def test_an_admin_signs_in_with_the_pages_form_and_gets_the_action_forms(
        s: Site, redis_url: str) -> None:
    """The sign-in form of every page and the forms an admin gets, against the real
    access rules (mtq.dashboard.web.auth): each carries the session's csrf and next."""
    from mtq.client import apikeys

    token, key = apikeys.create(s.redis, "ops", admin=True, name="dashboard test")
    waiting = mtq.Queue(s.sched, redis_url).submit({"to": "cancel"}, tenant="ops")
    base = f"/queues/{s.served}"
    try:
        with httpx.Client(base_url=s.base, timeout=15) as browser:
            page = browser.get(f"{base}?page=1").text
            (signin,) = re.findall(r'<form method="post" action="/login".*?</form>', page, re.S)
            csrf = re.search(r'name="csrf" value="([^"]+)"', signin)
            assert csrf is not None and f'name="next" value="{base}?page=1"' in signin
            r = browser.post("/login", data={"key": token, "csrf": unescape(csrf.group(1)),
                                             "next": f"{base}?page=1"})
            assert r.status_code == 303, r.text
            page = browser.get(r.headers["location"]).text
            forms = re.findall(r'<form method="post" action="([^"]+)".*?</form>', page, re.S)
            actions = [unescape(a) for a in forms]
            assert actions.count(f"{base}/dead/retry") == 2  # one letter, and all
            assert actions.count(f"{base}/dead/purge") == 2
            for a in ("/logout", f"{base}/pause", f"{base}/resume", f"{base}/drain",
                      f"{base}/scale"):
                assert a in actions, (a, actions)
            assert "/login" not in actions and f"admin {key.id}" in text_of(page)
            tokens = set(re.findall(r'name="csrf" value="([^"]+)"', page))
            assert len(tokens) == 1 and tokens != {csrf.group(1)}  # the session's own
            assert page.count('name="next"') == len(forms)
            assert f'name="id" value="{s.dead}"' in page and 'name="replicas"' in page
            assert 'max="256"' in page  # what the scale action takes (MAX_REPLICAS)
            # the cancel form of a waiting task, sent as the browser would
            page = browser.get(f"/tasks/{waiting.id}").text
            (cancel,) = re.findall(r'<form method="post" action="([^"]+/cancel)".*?</form>',
                                   page, re.S)
            fields = dict(re.findall(r'name="(\w+)" value="([^"]*)"', page.split(cancel)[1]
                                     .split("</form>")[0]))
            r = browser.post(unescape(cancel), data={k: unescape(v) for k, v in fields.items()})
            assert r.status_code == 303, r.text
            done = browser.get(r.headers["location"]).text
            assert 'id="flash"' in done and "status cancelled" in text_of(done)
            assert waiting.status() == "cancelled"
            assert f'action="/tasks/{s.done[0]}/cancel"' not in \
                browser.get(f"/tasks/{s.done[0]}").text  # an ended task has none
    finally:
        apikeys.revoke(s.redis, key.id)
