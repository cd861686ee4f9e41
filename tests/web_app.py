"""The ASGI application the web tests serve with a real uvicorn process
(``python -m uvicorn tests.web_app:app``), configured by environment variables:

* ``MTQ_REDIS_URL``: the Redis server.
* ``MTQ_WEB_CLIENT_NAME``: the name every Redis connection of the process announces
  (CLIENT SETNAME), so a test can count them in CLIENT LIST.
* ``MTQ_WEB_KEEPALIVE``: seconds between keep-alive comments (default 15).

Routes, for any queue (each test uses a queue of its own):

* ``/q/{queue}/tasks...``: :class:`mtq.contrib.asgi.TaskRoutes` mounted as a
  Starlette sub-application; the stream of a submit is the ``X-User`` header's.
  ``X-User`` also authenticates the request as that user (AuthenticationMiddleware),
  so a submit's tenant is the default one, the user's.
* ``/qc/{queue}/tasks...``: the same with cancel-on-disconnect.
* ``/s/{queue}/tasks...``: the default stream of a request (its session).
* ``/chat`` (POST) and ``/chat/{task_id}/events``: FastAPI endpoints on the queue
  ``MTQ_WEB_CHAT_QUEUE``, with the :func:`~mtq.contrib.asgi.submitter` dependency
  and an :class:`~mtq.contrib.asgi.EventStreamResponse`.
* ``/healthz``.
"""

import os
from typing import Annotated, Any

from fastapi import Depends, FastAPI
from starlette.authentication import (
    AuthCredentials,
    AuthenticationBackend,
    BaseUser,
    SimpleUser,
)
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.middleware.sessions import SessionMiddleware
from starlette.requests import HTTPConnection, Request
from starlette.types import Receive, Scope, Send

import mtq
from mtq.broker.connection import connect
from mtq.contrib.asgi import (
    EventStreamResponse,
    Submit,
    TaskRoutes,
    add_error_handlers,
    submitter,
    user_stream,
)

client = connect(os.environ["MTQ_REDIS_URL"], name=os.environ["MTQ_WEB_CLIENT_NAME"])
KEEPALIVE = float(os.environ.get("MTQ_WEB_KEEPALIVE", "15"))

_queues: dict[str, mtq.Queue] = {}


def queue(name: str) -> mtq.Queue:
    if name not in _queues:
        _queues[name] = mtq.Queue(name, client=client)
    return _queues[name]


def header_user(request: Request) -> str | None:
    return request.headers.get("x-user")


class HeaderAuth(AuthenticationBackend):
    """A user named by the ``X-User`` header (tests only)."""

    async def authenticate(self, conn: HTTPConnection
                           ) -> tuple[AuthCredentials, BaseUser] | None:
        name = conn.headers.get("x-user")
        return (AuthCredentials(["authenticated"]), SimpleUser(name)) if name else None


class PerQueue:
    """TaskRoutes for the queue named in the mount's path, made on first use."""

    def __init__(self, **options: Any) -> None:
        self.options = options
        self.apps: dict[str, Any] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        name = scope["path_params"]["queue"]
        if name not in self.apps:
            self.apps[name] = TaskRoutes(queue(name), keepalive_s=KEEPALIVE,
                                         **self.options).app()
        await self.apps[name](scope, receive, send)


app = FastAPI()
app.add_middleware(SessionMiddleware, secret_key="web-tests-only")
app.add_middleware(AuthenticationMiddleware, backend=HeaderAuth())
add_error_handlers(app)
app.mount("/q/{queue}", PerQueue(stream_of=header_user))
app.mount("/qc/{queue}", PerQueue(stream_of=header_user, cancel_on_disconnect=True))
app.mount("/s/{queue}", PerQueue(stream_of=user_stream))


@app.get("/healthz")
def healthz() -> dict[str, Any]:
    return {"ok": True, "pid": os.getpid()}


#: the queue of the FastAPI endpoints (``MTQ_WEB_CHAT_QUEUE``)
CHAT = queue(os.environ.get("MTQ_WEB_CHAT_QUEUE", "web-chat"))


@app.post("/chat", status_code=202)
async def chat(body: dict[str, Any],
               submit: Annotated[Submit, Depends(submitter(CHAT, header_user))]
               ) -> dict[str, Any]:
    task = await submit(body)
    return {"id": task.id}


@app.get("/chat/{task_id}/events")
def chat_events(task_id: str) -> EventStreamResponse:
    return EventStreamResponse(CHAT.task(task_id), keepalive_s=KEEPALIVE)
