"""The web dashboard as a Starlette application: ``mtq dashboard --web`` serves it at
``/``, ``mtq serve`` mounts it at ``/dashboard`` (see docs/dashboard.md).

Pages (Jinja2 templates, autoescaped: every value read from Redis is escaped):

* ``/``: the queues with a chart each, tenants and bands, workers, recent failures;
* ``/queues/{queue}``: its charts, tenants, busiest streams and longest waits, recent
  failures, workers, dead letters (``?page=N``), and the actions' forms;
* ``/tasks/{task_id}`` (``?queue=`` optional): its fields, trace as a timeline,
  payload and result previews, its tokens live while it streams, the cancel form.

``/events``, ``/queues/{queue}/events`` and ``/tasks/{task_id}/events`` stream each
page's live sections (:mod:`mtq.dashboard.web.live`); ``/tasks/{task_id}/stream`` is
the task's own event stream (:class:`mtq.contrib.asgi.EventStreamResponse`). All the
queue figures come from one :class:`~mtq.dashboard.web.sampler.Sampler` per app;
what the live sections of a queue or task page read beyond it is read once per refresh
however many pages show it (a page loaded reads afresh: after an action it shows the
outcome). Actions (the forms' targets, sign-in) are :mod:`mtq.dashboard.web.auth`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import jinja2
import redis
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from mtq.admin import QueueView
from mtq.broker.records import TERMINAL
from mtq.broker.tenants import shown_tenant, top_rows
from mtq.contrib.asgi import EventStreamResponse
from mtq.dashboard.web import auth, reads
from mtq.dashboard.web.charts import chart, timeline
from mtq.dashboard.web.fmt import FILTERS
from mtq.dashboard.web.live import FragmentStream, Render, until_stopped
from mtq.dashboard.web.rules import SecurityHeaders
from mtq.dashboard.web.sampler import Sampler
from mtq.errors import BrokerError, InvalidName, TaskNotFound

HERE = Path(__file__).parent
#: seconds the overview's small charts span, and the queue page's
SMALL_WINDOW_S, LARGE_WINDOW_S = 300.0, 600.0
#: tenant rows per queue, workers and failures shown
TENANT_ROWS, FAILURE_ROWS = 10, 20

OVERVIEW = ("banner", "summary", "queues", "tenants", "workers", "failures")
QUEUE = ("banner", "qfigures", "qcharts", "tenants", "streams", "failures", "workers")
TASK = ("tstatus", "ttrace", "toutcome")


def _seg(value: Any) -> str:
    """A value as one URL path segment."""
    return quote(str(value), safe="")


class Dashboard:
    """The dashboard's state: the Redis client, the sampler, the templates."""

    def __init__(self, client: redis.Redis, refresh_s: float = 1.0, *,
                 show_previews: bool = True) -> None:
        self.client = client
        self.sampler = Sampler(client, refresh_s)
        self.show_previews = show_previews
        self.env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"),
                                      autoescape=True, trim_blocks=True, lstrip_blocks=True)
        self.env.filters.update(FILTERS)
        self.env.filters["seg"] = _seg
        self.env.filters["tenant"] = shown_tenant
        self._cache: dict[Any, tuple[int, asyncio.Future[Any]]] = {}
        self._rendered: dict[Any, tuple[int, tuple[dict[str, str], bool]]] = {}

    # -- shared reads --------------------------------------------------------------
    async def once_per_refresh(self, key: Any, read: Callable[[], Any], fresh: bool = False
                               ) -> Any:
        """``read()`` (in a thread) at most once per refresh for every caller of ``key``;
        ``fresh``: read now (a page loaded, perhaps after an action: it shows the present),
        and share that read with the live streams of this refresh."""
        version = self.sampler.version
        hit = self._cache.get(key)
        if hit is not None and hit[0] == version and not fresh:
            return await asyncio.shield(hit[1])
        if len(self._cache) > 256:
            self._cache = {k: v for k, v in self._cache.items() if v[0] == version}
        fut: asyncio.Future[Any] = asyncio.ensure_future(asyncio.to_thread(read))
        self._cache[key] = (version, fut)
        return await asyncio.shield(fut)

    # -- contexts ------------------------------------------------------------------
    def base(self, request: Request, live: str | None) -> dict[str, Any]:
        root = str(request.scope.get("root_path", "")).rstrip("/")
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        snap = self.sampler.last
        return {"root": root, "live": live, "next": path, "refresh_s": self.sampler.refresh_s,
                "error": self.sampler.error, "seen": snap.ts if snap else None,
                "now": time.time(), "admin": None, "csrf": "", "flash": None}

    async def viewer(self, request: Request) -> dict[str, Any]:
        """Who is reading (:mod:`mtq.dashboard.web.auth`: it reads Redis, so in a
        thread): the admin key or None, the forms' CSRF token, an action's flash."""
        def read() -> dict[str, Any]:
            return {"admin": auth.admin(request), "csrf": auth.csrf_token(request),
                    "flash": auth.flash(request), "flash_kind": auth.flash_kind(request)}

        got = await run_in_threadpool(read)
        got["previews"] = self.show_previews or got["admin"] is not None
        return got

    def overview(self) -> dict[str, Any]:
        snap = self.sampler.last
        queues = []
        for q in snap.queues if snap else []:
            queues.append({"view": q, "rate": self.sampler.rate(q.name), "chart": chart(
                [("rate", "tasks/s", self.sampler.series(q.name, "rate", SMALL_WINDOW_S)),
                 ("waiting", "waiting", self.sampler.series(q.name, "waiting", SMALL_WINDOW_S))],
                window_s=SMALL_WINDOW_S)})
        failures = sorted(({**f, "queue": q.name} for q in (snap.queues if snap else [])
                           for f in q.failures), key=lambda f: f.get("ts") or 0, reverse=True)
        return {"snap": snap, "queues": queues,
                "tenants": self.tenants(snap.queues if snap else []),
                "workers": self.workers(None), "failures": failures[:FAILURE_ROWS],
                "totals": self.totals()}

    def totals(self) -> dict[str, Any]:
        snap = self.sampler.last
        qs = snap.queues if snap else []
        rates = [r for q in qs if (r := self.sampler.rate(q.name)) is not None]
        return {"queues": len(qs), "waiting": sum(q.waiting for q in qs),
                "running": sum(q.running for q in qs), "dead": sum(q.dead for q in qs),
                "rate": sum(rates) if rates else None,
                "workers": len(snap.workers) if snap else 0}

    def tenants(self, queues: list[QueueView]) -> list[dict[str, Any]]:
        return [{"queue": q.name, "lanes": len(q.tenants), "rows": top_rows(q.tenants, TENANT_ROWS)}
                for q in queues if q.tenants]

    def workers(self, queue: str | None) -> list[dict[str, Any]]:
        snap = self.sampler.last
        rows = [w for w in (snap.workers if snap else [])
                if queue is None or w.get("queue") == queue]
        return sorted(rows, key=lambda w: (str(w.get("queue")), str(w.get("id"))))

    async def queue(self, name: str, fresh: bool = False) -> dict[str, Any]:
        snap = self.sampler.last
        view = snap.queue(name) if snap else None
        s = self.sampler.series

        def big(*lines: tuple[str, str, str]) -> Any:
            return chart([(css, label, s(name, fld, LARGE_WINDOW_S)) for css, label, fld in lines],
                         width=560, height=140, window_s=LARGE_WINDOW_S)

        details = await self.once_per_refresh(
            ("queue", name), lambda: reads.queue_details(self.client, name), fresh)
        return {"name": name, "view": view, "rate": self.sampler.rate(name),
                "charts": [("throughput (tasks/s)", big(("rate", "tasks/s", "rate"))),
                           ("waiting and running", big(("waiting", "waiting", "waiting"),
                                                       ("running", "running", "running"))),
                           ("latency, submit to finish (ms)",
                            big(("p50", "p50", "p50_ms"), ("p99", "p99", "p99_ms")))],
                "tenants": self.tenants([view] if view else []), "details": details,
                "failures": view.failures if view else [], "workers": self.workers(name)}

    async def task(self, task_id: str, queue: str | None, fresh: bool = False
                   ) -> dict[str, Any]:
        # a page loaded (fresh) shows the payload; its live sections do not read it
        d = await self.once_per_refresh(
            ("task", task_id, queue),
            lambda: reads.task_details(self.client, task_id, queue, payload=fresh), fresh)
        entries = [(e.ts, e.kind, e.detail) for e in d.trace]
        return {"t": d, "timeline": timeline(entries, time.time()),
                "ended": d.info.status in TERMINAL}

    # -- rendering -----------------------------------------------------------------
    def page(self, name: str, ctx: dict[str, Any], status: int = 200) -> HTMLResponse:
        return HTMLResponse(self.env.get_template(name).render(ctx), status_code=status)

    def sections(self, ids: tuple[str, ...], ctx: dict[str, Any]) -> dict[str, str]:
        return {i: self.env.get_template(f"_{i}.html").render(ctx) for i in ids}

    async def shared(self, key: Any, build: Render) -> tuple[dict[str, str], bool]:
        """A page's live sections, rendered once a refresh for all its viewers (they
        hold no form and nothing of the viewer's own: ``key`` names what they show)."""
        version = self.sampler.version
        hit = self._rendered.get(key)
        if hit is not None and hit[0] == version:
            return hit[1]
        out = await build()
        if len(self._rendered) > 256:
            self._rendered = {k: v for k, v in self._rendered.items() if v[0] == version}
        self._rendered[key] = (version, out)
        return out

    async def not_found(self, request: Request, what: str, hint: str) -> HTMLResponse:
        return self.page("not_found.html", {**self.base(request, None),
                                            **await self.viewer(request), "what": what,
                                            "hint": hint}, 404)

    def unreachable(self, request: Request, exc: Exception) -> HTMLResponse:
        ctx = self.base(request, None)  # read-only: signing in needs Redis too
        ctx["error"] = str(exc)
        return self.page("unreachable.html", ctx, 503)

    # -- endpoints -----------------------------------------------------------------
    async def overview_page(self, request: Request) -> Response:
        self.sampler.start()
        await self.first()
        ctx = {**self.base(request, "/events"), **await self.viewer(request), **self.overview()}
        return self.page("overview.html", ctx)

    async def overview_events(self, request: Request) -> Response:
        self.sampler.start()
        base = self.base(request, None)

        async def build() -> tuple[dict[str, str], bool]:
            return self.sections(OVERVIEW, {**base, **self.live_base(), **self.overview()}), False

        async def render() -> tuple[dict[str, str], bool]:
            return await self.shared(("overview", base["root"]), build)

        return FragmentStream(self.sampler, render)  # type: ignore[return-value]

    def live_base(self) -> dict[str, Any]:
        snap = self.sampler.last
        return {"error": self.sampler.error, "seen": snap.ts if snap else None, "now": time.time()}

    async def queue_page(self, request: Request) -> Response:
        name = request.path_params["queue"]
        self.sampler.start()
        try:
            if not await asyncio.to_thread(reads.queue_known, self.client, name):
                return await self.not_found(request, f"no queue named {name!r}",
                                      "Queues appear once a task is submitted to them; the "
                                      "overview lists every queue Redis knows.")
            await self.first()
            try:
                page = max(1, int(request.query_params.get("page", "1")))
            except ValueError:
                page = 1
            dead, total = await asyncio.to_thread(reads.dead_page, self.client, name, page)
            ctx = {**self.base(request, f"/queues/{_seg(name)}/events"),
                   **await self.viewer(request), **await self.queue(name, fresh=True)}
        except BrokerError as exc:
            return self.unreachable(request, exc)
        pages = max(1, -(-total // reads.DEAD_PAGE))
        return self.page("queue.html", {**ctx, "dead": dead, "dead_total": total,
                                        "page": min(page, pages), "pages": pages})

    async def queue_events(self, request: Request) -> Response:
        name = request.path_params["queue"]
        self.sampler.start()
        base = self.base(request, None)

        async def build() -> tuple[dict[str, str], bool]:
            try:
                ctx = {**base, **self.live_base(), **await self.queue(name)}
            except BrokerError:  # the banner says why; the rest stays as it was
                return self.sections(("banner",), {**base, **self.live_base()}), False
            return self.sections(QUEUE, ctx), False

        async def render() -> tuple[dict[str, str], bool]:
            return await self.shared(("queue", name, base["root"]), build)

        return FragmentStream(self.sampler, render)  # type: ignore[return-value]

    async def task_page(self, request: Request) -> Response:
        task_id = request.path_params["task_id"]
        queue = request.query_params.get("queue") or None
        self.sampler.start()
        try:
            ctx = await self.task(task_id, queue, fresh=True)
        except (TaskNotFound, InvalidName) as exc:
            return await self.not_found(request, f"no task {task_id!r}",
                                  f"{exc}. Tasks are found by their id in every known queue; "
                                  "a queue page lists its recent failures and dead letters.")
        except BrokerError as exc:
            return self.unreachable(request, exc)
        q = f"?queue={quote(ctx['t'].queue, safe='')}"
        live = None if ctx["ended"] else f"/tasks/{_seg(task_id)}/events{q}"
        try:
            viewer = await self.viewer(request)
        except BrokerError as exc:
            return self.unreachable(request, exc)
        return self.page("task.html", {**self.base(request, live), **ctx, **viewer,
                                       "stream": f"/tasks/{_seg(task_id)}/stream{q}"})

    async def task_events(self, request: Request) -> Response:
        task_id = request.path_params["task_id"]
        queue = request.query_params.get("queue") or None
        self.sampler.start()
        previews = self.show_previews or await run_in_threadpool(auth.admin, request) is not None
        base = {**self.base(request, None), "previews": previews}

        async def build() -> tuple[dict[str, str], bool]:
            try:
                ctx = await self.task(task_id, queue)
            except (TaskNotFound, InvalidName):
                return {}, True   # none (any more): nothing will change
            except BrokerError:
                return {}, False
            return self.sections(TASK, {**base, **ctx}), ctx["ended"]

        async def render() -> tuple[dict[str, str], bool]:
            return await self.shared(("task", task_id, queue, base["root"], base["previews"]),
                                     build)

        return FragmentStream(self.sampler, render)  # type: ignore[return-value]

    async def task_stream(self, request: Request) -> Response:
        """The task's own events (tokens as they come), for the task page's EventSource."""
        from mtq.admin import find_task

        if not self.show_previews and await run_in_threadpool(auth.admin, request) is None:
            return JSONResponse({"error": "forbidden", "detail": "sign in with an admin key "
                                 "to read tasks' tokens on this dashboard"}, 403)
        task_id = request.path_params["task_id"]
        queue = request.query_params.get("queue") or None
        self.sampler.start()  # until_stopped waits on it (mounted: no lifespan started it)
        try:
            task = await asyncio.to_thread(find_task, self.client, task_id, queue)
        except (TaskNotFound, InvalidName) as exc:
            return JSONResponse({"error": "not_found", "detail": str(exc)}, 404)
        except BrokerError as exc:  # a 503 that says why, not a 500
            return JSONResponse({"error": "unavailable", "detail": str(exc)}, 503)
        stream = until_stopped(EventStreamResponse(task, cancel_on_disconnect=False),
                               self.sampler)
        return stream  # type: ignore[return-value]

    async def first(self, timeout: float = 5.0) -> None:
        """Wait (bounded) for the first refresh, so a page is never empty for nothing."""
        if self.sampler.version == 0:
            await self.sampler.wait(0, timeout)

    async def missing(self, request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 500)
        if status != 404:
            return HTMLResponse(f"{status}", status_code=status)
        return await self.not_found(request, f"nothing at {request.url.path}",
                              "The dashboard has the overview, a page per queue "
                              "(/queues/NAME) and a page per task (/tasks/ID).")


def create_dashboard(url: str | None = None, *, client: redis.Redis | None = None,
                     refresh_s: float = 1.0, show_previews: bool = True,
                     origin: str | None = None) -> Starlette:
    """The web dashboard of the Redis at ``url`` (default: ``MTQ_REDIS_URL``, else the
    embedded server) or of ``client``, refreshed every ``refresh_s`` seconds.

    ``show_previews``: payloads, results, tracebacks and tokens are shown to every
    reader (True) or to signed-in admins only (False: what ``mtq dashboard --web``
    does beyond loopback). ``app.state.dashboard`` is the :class:`Dashboard`
    (``app.state.dashboard.sampler.stop_soon()`` ends its live streams, as at shutdown);
    ``app.state.client`` the Redis client. ``origin``: the dashboard's public origin
    behind a proxy that changes the Host header (:func:`mtq.dashboard.web.auth.configure`;
    ConfigError if it is not one)."""
    if client is None:
        from mtq.broker.connection import connect

        client = connect(url, name="mtq-dashboard")
    d = Dashboard(client, refresh_s, show_previews=show_previews)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        d.sampler.start()
        try:
            yield
        finally:
            await d.sampler.stop()

    routes = [
        Route("/", d.overview_page),
        Route("/events", d.overview_events),
        Route("/queues/{queue}", d.queue_page),
        Route("/queues/{queue}/events", d.queue_events),
        Route("/tasks/{task_id}", d.task_page),
        Route("/tasks/{task_id}/events", d.task_events),
        Route("/tasks/{task_id}/stream", d.task_stream),
        Mount("/static", app=StaticFiles(directory=HERE / "static"), name="static"),
        *auth.routes(),
    ]
    handler: Callable[[Request, Exception], Awaitable[Response]] = d.missing
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: handler})
    app.state.dashboard = d
    app.state.client = client
    auth.configure(app, origin=origin)
    app.add_middleware(SecurityHeaders)
    return app
