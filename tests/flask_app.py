"""The Flask application the web tests serve with a real gunicorn process
(``gunicorn 'tests.flask_app:create_app()'``) and drive with ``flask --app
tests.flask_app mtq ...``. Configured by environment variables: ``MTQ_FLASK_REDIS_URL``,
else ``MTQ_REDIS_URL`` (the Redis server), ``MTQ_QUEUE`` (the default queue), ``MTQ_WEB_KEEPALIVE`` (seconds
between keep-alive comments, default 15).

Routes, for any queue (each test uses a queue of its own):

* ``POST /q/<queue>/tasks``: the JSON body, submitted into the session's stream;
  202 with ``{"id", "stream", "events"}``.
* ``GET /q/<queue>/tasks/<id>/events``: the event stream.
* ``GET /qc/<queue>/tasks/<id>/events``: the same, cancelled on disconnect.
* ``GET /healthz``: ``{"pid"}``.

A request with an ``X-User`` header is that user's, logged in (``g.user``, the Flask
tutorial's convention), so a submit's tenant is the default one, the user's.
"""

import os
from types import SimpleNamespace
from typing import Any

from flask import Flask, g, request

from mtq.contrib.flask import MTQ, user_stream

mtq_ext = MTQ()


def create_app() -> Flask:
    app = Flask(__name__)
    app.config.update(SECRET_KEY="test only", MTQ_REDIS_URL=os.environ.get("MTQ_FLASK_REDIS_URL")
                      or os.environ["MTQ_REDIS_URL"],
                      MTQ_QUEUE=os.environ.get("MTQ_QUEUE", "default"))
    mtq_ext.init_app(app)
    keepalive = float(os.environ.get("MTQ_WEB_KEEPALIVE", "15"))

    @app.before_request
    def login() -> None:
        name = request.headers.get("X-User")
        g.user = SimpleNamespace(id=name) if name else None

    @app.post("/q/<queue>/tasks")
    def submit(queue: str) -> tuple[dict[str, Any], int]:
        task = mtq_ext.submit(request.get_json(), queue=queue)
        return {"id": task.id, "stream": user_stream(request),
                "events": f"/q/{queue}/tasks/{task.id}/events"}, 202

    @app.get("/q/<queue>/tasks/<task_id>/events")
    def events(queue: str, task_id: str) -> Any:
        return mtq_ext.event_stream(task_id, queue, keepalive_s=keepalive)

    @app.get("/qc/<queue>/tasks/<task_id>/events")
    def events_cancel(queue: str, task_id: str) -> Any:
        return mtq_ext.event_stream(task_id, queue, keepalive_s=keepalive,
                                    cancel_on_disconnect=True)

    @app.get("/healthz")
    def healthz() -> dict[str, int]:
        return {"pid": os.getpid()}

    return app

