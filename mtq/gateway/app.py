"""The OpenAI-compatible gateway: a Starlette application over mtq queues.

``create_app(url=..., models={name: queue})`` answers ``GET /v1/models``,
``POST /v1/chat/completions``, ``POST /v1/completions`` and ``POST /v1/embeddings``
(see docs/gateway.md). Each request is checked (:mod:`mtq.gateway.mapping`),
authenticated (:func:`key_of`), admitted against its key's rate (``keys.admit``), then
submitted as one mtq task (one per input for embeddings); a streamed answer reads the
task's events through :mod:`mtq.contrib.sse` (one shared reply subscription per
process) and a client that goes away cancels its task. Every error is an answer in
OpenAI's shape (:class:`~mtq.gateway.mapping.GatewayError`).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import redis
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from mtq.client import Queue, Task
from mtq.contrib.asgi import serve_event_stream
from mtq.contrib.sse import http_error, stream_name
from mtq.contrib.web import (
    DEADLINE_HEADER,
    PRIORITY_HEADER,
    fill_options,
    header_priority,
    retry_after,
)
from mtq.errors import MtqError, ResultTimeout, TaskFailed
from mtq.gateway.mapping import (
    GatewayError,
    Generation,
    answer,
    bad,
    chat_payload,
    completion_payload,
    embedding_inputs,
    embeddings_answer,
    model_name,
)
from mtq.gateway.streaming import CompletionStream

log = logging.getLogger(__name__)

__all__ = ["Gateway", "create_app"]

#: the largest request body taken (bytes); larger: 413
MAX_BODY_BYTES = 1 << 20
#: the longest a request waits for its task (seconds); then 504 and the task cancelled
TIMEOUT_S = 600.0
#: how long the model catalogue and "are there keys" are cached (seconds)
CACHE_S = 2.0
#: the priority of a request whose key and header give none
DEFAULT_PRIORITY = "interactive"


def _keys() -> Any:
    """:mod:`mtq.client.apikeys`, imported on first use (None if it is not there)."""
    try:
        return importlib.import_module("mtq.client.apikeys")
    except ImportError:
        return None


def _error_response(err: GatewayError) -> Response:
    return JSONResponse(err.body(), err.status, headers=err.headers)


def from_mtq(exc: MtqError) -> GatewayError:
    """An mtq error (a refused submit, an unreachable Redis) in OpenAI's shape."""
    err = http_error(exc)
    if err is None:
        return GatewayError(500, f"{type(exc).__name__}: {exc}", "server_error", None,
                            "internal")
    kind = {400: "invalid_request_error", 404: "invalid_request_error",
            413: "invalid_request_error", 429: "rate_limit_error"}.get(err.status,
                                                                      "server_error")
    headers = dict(err.headers)
    wait = getattr(exc, "retry_after", None)
    if isinstance(wait, (int, float)) and wait > 0:
        headers.update(waits(wait))
    return GatewayError(err.status, err.detail, kind, None, err.code, headers)


def waits(seconds: float) -> dict[str, str]:
    """``Retry-After`` (whole seconds, rounded up) and ``retry-after-ms`` (the exact
    wait, which the OpenAI SDKs prefer: their retry comes when it can succeed)."""
    return {"Retry-After": retry_after(seconds),
            "retry-after-ms": str(max(1, math.ceil(seconds * 1000)))}


def failed(exc: TaskFailed) -> GatewayError:
    """A task that ended other than succeeded: a payload the model refused is the
    client's error (400), anything else the server's (500)."""
    text = exc.error or exc.status
    if exc.status == "cancelled":
        return GatewayError(500, f"the request's task {exc.task_id} was cancelled",
                            "server_error", None, "cancelled")
    if text.startswith(("BadRequest", "PermanentError")) or "BadRequest:" in text:
        return GatewayError(400, text, "invalid_request_error", None, "model_refused")
    return GatewayError(500, f"the model failed: {text}", "server_error", None,
                        "model_failed")


class Gateway:
    """The gateway's state and endpoints (an app of its own: :attr:`app`)."""

    def __init__(self, client: redis.Redis, models: Mapping[str, str] | None = None, *,
                 require_keys: bool = False, dialects: Mapping[str, str] | None = None,
                 max_body_bytes: int = MAX_BODY_BYTES, timeout_s: float = TIMEOUT_S,
                 keepalive_s: float = 15.0) -> None:
        self.client = client
        self.models = dict(models or {})
        self.dialects = dict(dialects or {})
        self.require_keys = require_keys
        self.max_body_bytes = max_body_bytes
        self.timeout_s = timeout_s
        self.keepalive_s = keepalive_s
        self._queues: dict[str, Queue] = {}
        self._records: dict[str, tuple[float, dict[str, str]]] = {}
        self._any_keys: tuple[float, bool] = (0.0, False)
        routes = [
            Route("/v1/models", self.list_models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.get_model, methods=["GET"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/embeddings", self.embeddings, methods=["POST"]),
        ]
        self.app = Starlette(routes=routes, exception_handlers={
            HTTPException: self._http_error, GatewayError: self._gateway_error,
            MtqError: self._mtq_error, redis.RedisError: self._redis_error})

    # -- errors ------------------------------------------------------------------------
    async def _http_error(self, request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 500)
        what = {404: f"no route {request.method} {request.url.path}: see /v1/models, "
                     "/v1/chat/completions, /v1/completions, /v1/embeddings",
                405: f"method {request.method} is not allowed on {request.url.path}"}
        return _error_response(GatewayError(
            status, what.get(status, str(getattr(exc, "detail", exc))),
            "invalid_request_error", None,
            {404: "unknown_url", 405: "method_not_allowed"}.get(status)))

    async def _gateway_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, GatewayError)
        return _error_response(exc)

    async def _mtq_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, MtqError)
        return _error_response(from_mtq(exc))

    async def _redis_error(self, request: Request, exc: Exception) -> Response:
        log.warning("Redis error in %s: %s", request.url.path, exc)
        return _error_response(GatewayError(
            503, f"Redis is unreachable ({type(exc).__name__}); retry shortly",
            "server_error", None, "unavailable", {"Retry-After": "2"}))

    # -- requests ----------------------------------------------------------------------
    async def body(self, request: Request) -> Any:
        """The JSON body, at most :attr:`max_body_bytes` (413), well-formed (400)."""
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            raise self._too_large()
        chunks, size = [], 0
        async for piece in request.stream():
            size += len(piece)
            if size > self.max_body_bytes:
                raise self._too_large()
            chunks.append(piece)
        try:
            return json.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError) as exc:
            raise bad(f"the request body is not valid JSON: {exc}", None,
                      "invalid_json") from exc

    def _too_large(self) -> GatewayError:
        return GatewayError(413, f"the request body is over {self.max_body_bytes} bytes",
                            "invalid_request_error", None, "request_too_large")

    async def key_of(self, request: Request) -> Any:
        """The request's API key (``Authorization: Bearer <token>``), or None when keys
        are not required and none is needed: 401 for a missing or wrong key."""
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        token = token.strip() if scheme.lower() == "bearer" else ""
        keys = _keys()
        if not self.require_keys:
            # loopback: a token counts only once keys exist (the SDK always sends one)
            if not token or keys is None or not await self._keys_exist(keys):
                return None
        if not token:
            raise GatewayError(401, "missing API key: send 'Authorization: Bearer <key>' "
                               "(create one with 'mtq keys create --tenant T')",
                               "invalid_request_error", None, "missing_api_key")
        if keys is None:
            raise GatewayError(401, "API keys are not available in this installation",
                               "invalid_request_error", None, "invalid_api_key")
        try:
            return await asyncio.to_thread(keys.authenticate, self.client, token)
        except MtqError as exc:
            if type(exc).__name__ != "InvalidApiKey":
                raise
            raise GatewayError(401, f"invalid API key: {exc}", "invalid_request_error",
                               None, "invalid_api_key") from exc

    async def _keys_exist(self, keys: Any) -> bool:
        at, value = self._any_keys
        if time.monotonic() - at > CACHE_S:
            value = bool(await asyncio.to_thread(keys.any_keys, self.client))
            self._any_keys = (time.monotonic(), value)
        return value

    async def admit(self, key: Any, tokens: int) -> None:
        """429 with Retry-After when ``key`` is over its requests or tokens per minute."""
        if key is None:
            return
        keys = _keys()
        wait = float(await asyncio.to_thread(keys.admit, self.client, key, tokens))
        if wait > 0:
            raise GatewayError(429, f"rate limit of key {key.id} reached: retry in "
                               f"{wait:.1f} s", "rate_limit_error", None,
                               "rate_limit_exceeded", waits(wait))

    # -- models ------------------------------------------------------------------------
    def queue(self, name: str) -> Queue:
        q = self._queues.get(name)
        if q is None:
            q = self._queues[name] = Queue(name, client=self.client)
        return q

    def _record(self, queue: str) -> dict[str, str]:
        """The queue's model record (cached :data:`CACHE_S`)."""
        from mtq.broker import catalogue

        hit = self._records.get(queue)
        if hit is not None and time.monotonic() - hit[0] < CACHE_S:
            return hit[1]
        rec = catalogue.models(self.client, [queue]).get(queue, {})
        self._records[queue] = (time.monotonic(), rec)
        return rec

    async def resolve(self, model: str) -> tuple[Queue, str]:
        """The queue of ``model`` and its payload dialect; 404 for an unknown model."""
        from mtq.errors import InvalidName

        queue = self.models.get(model, model)
        try:
            q = self.queue(queue)
        except InvalidName as exc:
            raise self._unknown(model) from exc
        rec = await asyncio.to_thread(self._record, queue)
        if not rec and model not in self.models:
            raise self._unknown(model)
        dialect = self.dialects.get(model) or self.dialects.get(queue) or (
            "reference" if "TinyGPT" in rec.get("target", "") else "hf")
        return q, dialect

    @staticmethod
    def _unknown(model: str) -> GatewayError:
        return GatewayError(404, f"the model '{model}' does not exist: see GET /v1/models",
                            "invalid_request_error", "model", "model_not_found")

    def _served(self) -> list[dict[str, Any]]:
        from mtq.broker import catalogue
        from mtq.broker.registry import list_workers

        workers = list_workers(self.client)
        queues = sorted({str(w["queue"]) for w in workers if w.get("queue")}
                        | set(self.models.values()))
        rows = catalogue.served(workers, catalogue.models(self.client, queues))
        live = {r["queue"]: r for r in rows if r["replicas"] and r["current"]}
        out = []
        names = {q: q for q in live} | {n: q for n, q in self.models.items() if q in live}
        for name, q in sorted(names.items()):
            row = live[q]
            out.append({"id": name, "object": "model", "created": int(row["loaded"] or 0),
                        "owned_by": "mtq", "queue": q, "target": row["target"],
                        "replicas": row["replicas"]})
        return out

    async def list_models(self, request: Request) -> Response:
        await self.key_of(request)
        return JSONResponse({"object": "list", "data": await asyncio.to_thread(self._served)})

    async def get_model(self, request: Request) -> Response:
        await self.key_of(request)
        name = request.path_params["model"]
        for row in await asyncio.to_thread(self._served):
            if row["id"] == name:
                return JSONResponse(row)
        raise self._unknown(name)

    # -- submitting --------------------------------------------------------------------
    @staticmethod
    def options(request: Request, key: Any) -> dict[str, Any]:
        """A request's submit options: the key's tenant; the key's priority, else the
        ``X-Mtq-Priority`` header's, else interactive; the ``X-Mtq-Deadline`` header's
        deadline. Read before the request is admitted: a bad header (400) costs its
        key nothing."""
        return fill_options(
            {}, request, lambda r: getattr(key, "tenant", None),
            lambda r: (getattr(key, "priority", None)
                       or header_priority(r.headers.get(PRIORITY_HEADER)) or DEFAULT_PRIORITY),
            request.headers.get(DEADLINE_HEADER))

    async def submit(self, q: Queue, payload: Any, key: Any, user: str | None,
                     options: dict[str, Any], streamed: bool = True) -> Task:
        """One task, with ``options`` (:meth:`options`): in the stream of the request's
        ``user`` (within its key), else of its key."""
        key_id = getattr(key, "id", None)
        stream = None
        if streamed:
            if user is not None:
                stream = stream_name("user", f"{key_id}/{user}" if key_id else user)
            elif key_id is not None:
                stream = stream_name("key", key_id)
        return await asyncio.to_thread(q.submit, payload, stream=stream, **options)

    async def wait(self, request: Request, tasks: list[Task]) -> list[Any]:
        """The tasks' results; a client that goes away, or :attr:`timeout_s` passed
        (504), cancels those not finished."""

        async def gone() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        results = asyncio.ensure_future(asyncio.gather(
            *(t.aresult(timeout=self.timeout_s) for t in tasks)))
        listening = asyncio.ensure_future(gone())
        try:
            await asyncio.wait({results, listening}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            listening.cancel()
            if not results.done():
                results.cancel()
            with contextlib.suppress(BaseException):
                await listening
        if results.cancelled() or not results.done():
            await self._cancel(tasks)
            raise GatewayError(499, "the client went away", "invalid_request_error")
        exc = results.exception()
        if exc is None:
            return list(results.result())
        if isinstance(exc, ResultTimeout):
            await self._cancel(tasks)
            raise GatewayError(504, f"no answer within {self.timeout_s:g} s; the request's "
                               f"task {tasks[0].id} was cancelled", "server_error", None,
                               "timeout") from exc
        if isinstance(exc, TaskFailed):
            await self._cancel(tasks)
            raise failed(exc) from exc
        raise exc

    @staticmethod
    async def _cancel(tasks: list[Task]) -> None:
        for t in tasks:
            try:
                await asyncio.to_thread(t.cancel)
            except MtqError as exc:
                log.debug("cancel of %s: %s", t.id, exc)

    # -- endpoints ---------------------------------------------------------------------
    async def _generate(self, request: Request, parse: Callable[[Any, str], Generation]
                        ) -> Response:
        body = await self.body(request)
        key = await self.key_of(request)
        q, dialect = await self.resolve(model_name(body))
        gen = parse(body, dialect)
        options = self.options(request, key)
        await self.admit(key, gen.budget)
        task = await self.submit(q, gen.payload, key, gen.user, options)
        if gen.stream:
            return StreamResponse(CompletionStream(task, gen, keepalive_s=self.keepalive_s,
                                                   timeout=self.timeout_s))
        (result,) = await self.wait(request, [task])
        return JSONResponse(answer(gen, task.id, result))

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, chat_payload)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, completion_payload)

    async def embeddings(self, request: Request) -> Response:
        body = await self.body(request)
        key = await self.key_of(request)
        model, texts, user, b64 = embedding_inputs(body)
        q, _dialect = await self.resolve(model)
        options = self.options(request, key)
        await self.admit(key, sum(len(t) // 4 + 1 for t in texts))
        tasks = []
        try:
            for text in texts:  # no stream: the inputs are batched, not run one by one
                tasks.append(await self.submit(q, text, key, user, options, streamed=False))
        except BaseException:
            await self._cancel(tasks)
            raise
        results = await self.wait(request, tasks)
        return JSONResponse(embeddings_answer(model, results, texts, b64))


class StreamResponse(Response):
    """A :class:`CompletionStream` sent as ``text/event-stream`` (disconnects cancel
    the task: :func:`mtq.contrib.asgi.serve_event_stream`)."""

    def __init__(self, stream: CompletionStream) -> None:
        self.status_code = 200
        self.background = None
        self.raw_headers = []
        self.stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await serve_event_stream(self.stream, scope, receive, send)


def create_app(url: str | None = None, models: Mapping[str, str] | None = None, *,
               client: redis.Redis | None = None, require_keys: bool = False,
               dialects: Mapping[str, str] | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, timeout_s: float = TIMEOUT_S,
               keepalive_s: float = 15.0) -> Starlette:
    """The gateway as a Starlette application (mount it in a FastAPI or Starlette app,
    or serve it with uvicorn: ``mtq serve``).

    ``url`` / ``client``: the Redis (default: ``MTQ_REDIS_URL``, else the embedded
    server). ``models``: model name -> queue (a name not there is the queue of that
    name, if a model was ever served on it). ``require_keys``: every request needs an
    API key (``mtq serve`` sets it unless it listens on loopback only).
    ``dialects``: model or queue -> ``"hf"`` or ``"reference"`` (default: read from the
    queue's model record). ``max_body_bytes``: larger bodies are a 413.
    ``timeout_s``: the longest a request waits for its task (then 504, the task
    cancelled). ``keepalive_s``: a comment sent on an idle stream that often."""
    if client is None:
        from mtq.broker.connection import connect

        client = connect(url, name="mtq-gateway")
    return Gateway(client, models, require_keys=require_keys, dialects=dialects,
                   max_body_bytes=max_body_bytes, timeout_s=timeout_s,
                   keepalive_s=keepalive_s).app

