"""The example chat page (chat.html) served by Flask over mtq.contrib.flask.

    mtq workers start mtq.reference.gpt:TinyGPT --queue chat &
    gunicorn -k gthread --threads 32 examples.web.flask_chat:app   # http://127.0.0.1:8000

(or ``flask --app examples.web.flask_chat run``, Flask's development server).

Served by a Hugging Face model instead: ``mtq workers start hf:CausalLM --queue chat
--set model=Qwen/Qwen2.5-0.5B-Instruct`` (or a local folder), and ``MTQ_CHAT_MESSAGES=1``
in the app's environment so that each prompt goes as a chat message
(:func:`examples.web.chat_payload`; docs/models.md).

* ``GET /``: the page.
* ``POST /chat``: ``{"prompt": str, "max_tokens": int}`` submitted (as
  :func:`examples.web.chat_payload`) into this browser's
  own stream (its session: FIFO per user, users served fairly); 202 with
  ``{"id", "events"}``; 400 for a bad body. A full queue: 503 with Retry-After.
* ``GET /chat/<id>/events``: the task's server-sent events, resuming after
  ``Last-Event-ID`` (or ``?last_event_id=``). A tab closed before the end cancels its
  task (noticed at the next token the server cannot write) unless a stream of the
  task opens again within ``RELOAD_GRACE_S``: a reloaded page keeps its task.

Each open stream holds a server thread: serve it with threads (gthread) or gevent.
Environment: ``MTQ_QUEUE`` (``chat``), ``MTQ_REDIS_URL`` (else mtq's embedded server,
the one ``mtq workers start`` uses too when it is unset), ``SECRET_KEY``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from flask import Flask, Response, request, send_file, url_for

from examples.web import chat_payload
from mtq.contrib.flask import MTQ

PAGE = Path(__file__).with_name("chat.html")
#: seconds a stream's task outlives its client, waiting for the page to come back
RELOAD_GRACE_S = 2.0
#: the most tokens one request may ask for (TinyGPT's context is 512, prompt included;
#: hf:CausalLM fails a request past its model's context with a BadRequest, shown on the page)
MAX_TOKENS = 400

app = Flask(__name__)
app.config.update(SECRET_KEY=os.environ.get("SECRET_KEY", "change me"),
                  MTQ_REDIS_URL=os.environ.get("MTQ_REDIS_URL") or None,  # None: embedded
                  MTQ_QUEUE=os.environ.get("MTQ_QUEUE") or "chat")
mtq_ext = MTQ(app)  # a full queue: 503 + Retry-After; an unknown task: 404; `flask mtq`


@app.get("/")
def page() -> Response:
    return send_file(PAGE, mimetype="text/html")


@app.post("/chat")
def ask() -> tuple[dict[str, Any], int]:
    body = request.get_json(silent=True)
    prompt = body.get("prompt") if isinstance(body, dict) else None
    max_tokens = body.get("max_tokens", 64) if isinstance(body, dict) else None
    if not isinstance(prompt, str) or len(prompt) > 4000 or not (
            isinstance(max_tokens, int) and not isinstance(max_tokens, bool)
            and 1 <= max_tokens <= MAX_TOKENS):
        return {"error": "bad_request", "detail": "send JSON {\"prompt\": str (at most 4000 "
                f"characters), \"max_tokens\": int from 1 to {MAX_TOKENS}}}"}, 400
    task = mtq_ext.submit(chat_payload(prompt, max_tokens))  # the session's stream
    return {"id": task.id, "events": url_for("events", task_id=task.id)}, 202


@app.get("/chat/<task_id>/events")
def events(task_id: str) -> Response:
    return mtq_ext.event_stream(task_id, cancel_on_disconnect=True,
                                cancel_grace_s=RELOAD_GRACE_S)
