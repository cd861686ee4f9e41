"""The example chat page (chat.html) served by Django over mtq.contrib.django: a
one-file Django project, async views under ASGI.

    mtq workers start mtq.reference.gpt:TinyGPT --queue chat &   # or: python -m examples.web.django_chat mtq_workers
    python -m examples.web.django_chat                            # uvicorn on http://127.0.0.1:8000

Any other argument is a ``manage.py`` command: ``python -m examples.web.django_chat
check`` (mtq.E001 when Redis cannot be reached), ``... mtq_status``, ``... mtq_workers``
(``mtq workers start`` with this project's ``MTQ["WORKERS"]`` and ``MTQ["QUEUE"]``).
Under another server: ``uvicorn examples.web.django_chat:application``.

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
  ``Last-Event-ID`` (or ``?last_event_id=``); a tab closed before the end cancels its
  task, unless a stream of it opens again within ``RELOAD_GRACE_S``: a reloaded page
  keeps its task.

Async views and an async event stream: serve it with an ASGI server (uvicorn), where
an open stream costs no thread. (Under WSGI, write sync views with
``mtq.contrib.django.event_stream``: Django would read an async stream whole before
sending it.) Environment: ``MTQ_QUEUE`` (``chat``), ``MTQ_REDIS_URL`` (else mtq's
embedded server, the one ``mtq workers start`` uses too when it is unset),
``SECRET_KEY``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import django
from django.conf import settings

PAGE = Path(__file__).with_name("chat.html")
#: the most tokens one request may ask for (TinyGPT's context is 512, prompt included;
#: hf:CausalLM fails a request past its model's context with a BadRequest, shown on the page)
MAX_TOKENS = 400
#: a closed tab cancels its task unless a stream of it opens again within this time
#: (a reloaded page re-attaches and keeps its task)
RELOAD_GRACE_S = 2.0

if not settings.configured:
    settings.configure(
        DEBUG=False,
        SECRET_KEY=os.environ.get("SECRET_KEY", "change me"),
        ALLOWED_HOSTS=["127.0.0.1", "localhost"],
        ROOT_URLCONF=__name__,
        INSTALLED_APPS=["mtq.contrib.django"],
        MIDDLEWARE=["django.contrib.sessions.middleware.SessionMiddleware",
                    "mtq.contrib.django.middleware.MtqErrorMiddleware"],
        SESSION_ENGINE="django.contrib.sessions.backends.signed_cookies",  # no database
        MTQ={"QUEUE": os.environ.get("MTQ_QUEUE") or "chat",
             "WORKERS": "mtq.reference.gpt:TinyGPT"},  # REDIS_URL: MTQ_REDIS_URL, else embedded
    )
    django.setup()

from django.http import FileResponse, Http404, HttpRequest, HttpResponse  # noqa: E402
from django.urls import path  # noqa: E402
from django.views.decorators.http import require_GET, require_POST  # noqa: E402

import mtq.contrib.django as mtqd  # noqa: E402
from examples.web import chat_payload  # noqa: E402


@require_GET
async def page(request: HttpRequest) -> HttpResponse:
    if not PAGE.exists():
        raise Http404(f"{PAGE} is missing")
    return FileResponse(PAGE.open("rb"), content_type="text/html; charset=utf-8")


@require_POST
async def ask(request: HttpRequest) -> HttpResponse:
    try:
        body = json.loads(request.body)
    except ValueError:
        body = None
    prompt = body.get("prompt") if isinstance(body, dict) else None
    max_tokens = body.get("max_tokens", 64) if isinstance(body, dict) else None
    if not isinstance(prompt, str) or len(prompt) > 4000 or not (
            isinstance(max_tokens, int) and not isinstance(max_tokens, bool)
            and 1 <= max_tokens <= MAX_TOKENS):
        return mtqd.json_response({"error": "bad_request", "detail": (
            "send JSON {\"prompt\": str (at most 4000 characters), \"max_tokens\": int from "
            f"1 to {MAX_TOKENS}}}")}, 400)
    task = await mtqd.asubmit(request, chat_payload(prompt, max_tokens))
    return mtqd.json_response({"id": task.id, "events": f"/chat/{task.id}/events"}, 202)


@require_GET
async def events(request: HttpRequest, task_id: str) -> HttpResponse:
    return await mtqd.aevent_stream(request, task_id, cancel_on_disconnect=True,
                                    cancel_grace_s=RELOAD_GRACE_S)


urlpatterns = [
    path("", page),
    path("chat", ask),
    path("chat/<str:task_id>/events", events),
]

from django.core.asgi import get_asgi_application  # noqa: E402

application = get_asgi_application()


def main(argv: list[str]) -> None:
    """No arguments: serve on 127.0.0.1:8000 (``PORT``) with uvicorn; else a
    ``manage.py`` command."""
    if len(argv) > 1:
        from django.core.management import execute_from_command_line

        execute_from_command_line(argv)
        return
    import uvicorn

    uvicorn.run(application, host="127.0.0.1", port=int(os.environ.get("PORT", "8000")),
                lifespan="off", timeout_graceful_shutdown=5)


if __name__ == "__main__":
    main(sys.argv)
