"""Views for any queue (each test uses a queue of its own); ``/q/...`` sync (WSGI,
gunicorn), ``/aq/...`` async (ASGI, uvicorn):

* ``POST /q/<queue>/tasks``, ``POST /aq/<queue>/tasks``: the JSON body submitted into
  the user's stream (``X-User``: a logged-in user, else the session's); 202 with
  ``{"id", "stream", "events"}``.
* ``GET /q/<queue>/tasks/<id>/events``, ``/aq/...``: the event stream; ``/qc/...``,
  ``/aqc/...``: the same, cancelled on disconnect.
* ``POST /q/<queue>/orders``: ``{"item", "gate"?, "rollback"?}``: an Order row written
  in a transaction, and a task reading it submitted on commit. With ``gate``, the view
  pushes the task id to the Redis list ``<gate>:id`` and waits (up to 10 s) for an
  item on ``<gate>:go`` before it commits, so the test can look at Redis meanwhile.
* ``GET /healthz``: ``{"pid"}``.
"""

import json
import os
from typing import Any

import redis
from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import transaction
from django.http import HttpRequest, HttpResponse, JsonResponse

import mtq.contrib.django as mtqd
from mtq.contrib.django.conf import redis_url
from tests.django_project.models import Order


def healthz(request: HttpRequest) -> HttpResponse:
    return JsonResponse({"pid": os.getpid()})


def submit(request: HttpRequest, queue: str) -> HttpResponse:
    task = mtqd.submit(request, json.loads(request.body), queue=queue)
    return JsonResponse({"id": task.id, "stream": mtqd.stream_of(request),
                         "events": f"/q/{queue}/tasks/{task.id}/events"}, status=202)


def events(request: HttpRequest, queue: str, task_id: str) -> HttpResponse:
    return mtqd.event_stream(request, task_id, queue=queue)


def events_cancel(request: HttpRequest, queue: str, task_id: str) -> HttpResponse:
    return mtqd.event_stream(request, task_id, queue=queue, cancel_on_disconnect=True)


async def asubmit(request: HttpRequest, queue: str) -> HttpResponse:
    task = await mtqd.asubmit(request, json.loads(request.body), queue=queue)
    stream = await sync_to_async(mtqd.stream_of)(request)
    return JsonResponse({"id": task.id, "stream": stream,
                         "events": f"/aq/{queue}/tasks/{task.id}/events"}, status=202)


async def aevents(request: HttpRequest, queue: str, task_id: str) -> HttpResponse:
    return await mtqd.aevent_stream(request, task_id, queue=queue)


async def aevents_cancel(request: HttpRequest, queue: str, task_id: str) -> HttpResponse:
    return await mtqd.aevent_stream(request, task_id, queue=queue, cancel_on_disconnect=True)


class Rollback(Exception):
    pass


def order(request: HttpRequest, queue: str) -> HttpResponse:
    body: dict[str, Any] = json.loads(request.body)
    db = str(settings.DATABASES["default"]["NAME"])
    gate = body.get("gate")
    try:
        with transaction.atomic():
            row = Order.objects.create(item=body["item"])
            task = mtqd.submit_on_commit({"order": row.pk, "db": db}, request=request,
                                         queue=queue)
            if gate:
                r = redis.Redis.from_url(redis_url() or "")
                try:
                    r.rpush(f"{gate}:id", task.id)
                    if r.blpop([f"{gate}:go"], timeout=10) is None:
                        raise RuntimeError("the test never opened the gate")
                finally:
                    r.close()
            if body.get("rollback"):
                raise Rollback
    except Rollback:
        return JsonResponse({"id": task.id, "committed": False})
    return JsonResponse({"id": task.id, "order": row.pk, "committed": True}, status=202)
