"""The example chat page (chat.html) served by FastAPI over mtq.contrib.asgi.

    mtq workers start mtq.reference.gpt:TinyGPT --queue chat &
    uvicorn examples.web.fastapi_chat:app            # then open http://127.0.0.1:8000

Served by a Hugging Face model instead: ``mtq workers start hf:CausalLM --queue chat
--set model=Qwen/Qwen2.5-0.5B-Instruct`` (or a local folder), and ``MTQ_CHAT_MESSAGES=1``
in the app's environment so that each prompt goes as a chat message
(:func:`examples.web.chat_payload`; docs/models.md).

* ``GET /``: the page.
* ``POST /chat``: ``{"prompt": str, "max_tokens": int}`` submitted (as
  :func:`examples.web.chat_payload`) into this browser's
  own stream (its session: FIFO per user, users served fairly); 202 with
  ``{"id", "events"}``. A full queue: 503 with Retry-After.
* ``GET /chat/{id}/events``: the task's server-sent events, resuming after
  ``Last-Event-ID`` (or ``?last_event_id=``). A tab closed before the end cancels its
  task (its generation stops, freeing the worker's slot) unless a stream of the task
  opens again within ``RELOAD_GRACE_S``: a reloaded page keeps its task.

Environment: ``MTQ_QUEUE`` (``chat``), ``MTQ_REDIS_URL`` (else mtq's embedded server,
the one ``mtq workers start`` uses too when it is unset), ``SECRET_KEY`` (the session
cookie's key).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import FileResponse
from pydantic import BaseModel, Field
from starlette.middleware.sessions import SessionMiddleware

import mtq
from examples.web import chat_payload
from mtq.contrib.asgi import EventStreamResponse, Submit, add_error_handlers, submitter

PAGE = Path(__file__).with_name("chat.html")
#: seconds a stream's task outlives its client, waiting for the page to come back
RELOAD_GRACE_S = 2.0
#: the most tokens one request may ask for (TinyGPT's context is 512, prompt included;
#: hf:CausalLM fails a request past its model's context with a BadRequest, shown on the page)
MAX_TOKENS = 400

chat = mtq.Queue(os.environ.get("MTQ_QUEUE") or "chat")  # MTQ_REDIS_URL, else embedded

app = FastAPI(title="mtq chat")
# the session cookie makes a browser one user: its requests run in order
app.add_middleware(SessionMiddleware, secret_key=os.environ.get("SECRET_KEY", "change me"))
add_error_handlers(app)  # a full queue: 503 + Retry-After; an unknown task: 404


class Ask(BaseModel):
    prompt: str = Field(max_length=4000)
    max_tokens: int = Field(64, ge=1, le=MAX_TOKENS)


@app.get("/", include_in_schema=False)
def page() -> FileResponse:
    return FileResponse(PAGE, media_type="text/html")


@app.post("/chat", status_code=202)
async def ask(body: Ask, request: Request,
              submit: Annotated[Submit, Depends(submitter(chat))]) -> dict[str, Any]:
    task = await submit(chat_payload(body.prompt, body.max_tokens))
    return {"id": task.id, "events": request.url_for("events", task_id=task.id).path}


@app.get("/chat/{task_id}/events")
def events(task_id: str) -> EventStreamResponse:
    return EventStreamResponse(chat.task(task_id), cancel_on_disconnect=True,
                               cancel_grace_s=RELOAD_GRACE_S)
