"""What the web dashboard's admins can do: pause, resume, drain and scale a queue's
workers, cancel a task, retry or purge dead letters.

Each action is two steps: ``prepare`` checks every input (the path's queue or task
id, the form's fields) and raises a named error (InvalidName, InvalidArgument: a
400) before anything is sent; the function it returns then acts, with the dashboard's
Redis client, and returns a :class:`Done`. Who may act, CSRF and the answers are
:mod:`mtq.dashboard.web.auth`'s; nothing here knows about them.

Control commands go out as :mod:`mtq.broker.commands` messages on the queue's control
channel, as ``mtq workers pause|resume|drain|scale`` send them: the queue's
supervisors (and ``mtq worker run`` processes) that listen now receive them. None
listening is not an error of the request: :class:`Done` with status 409 says so,
and nothing changed.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mtq.broker.codes import Code
from mtq.broker.commands import message, publish
from mtq.client.admin import find_task
from mtq.client.queue import Queue
from mtq.errors import InvalidArgument, TaskNotFound
from mtq.validation import check_queue_name, check_task_id

#: the most processes per device ``scale`` sets (as ``mtq workers scale``)
MAX_REPLICAS = 256
#: the most dead letters one retry or purge names
MAX_IDS = 1000

#: a form: each field's values, in order (``id`` may repeat)
Form = Mapping[str, Sequence[str]]


@dataclass(frozen=True)
class Done:
    """What an action did: ``message`` for people (the flash), ``status`` 200, or 409
    when nothing changed because of the state of things (no supervisor listening, a
    task already ended), ``data`` for scripts (the JSON answer)."""

    message: str
    status: int = 200
    data: dict[str, Any] = field(default_factory=dict)


Act = Callable[[Any], Done]
Prepare = Callable[[Mapping[str, str], Form], Act]


def _one(form: Form, name: str) -> str | None:
    values = form.get(name) or []
    if len(values) > 1:
        raise InvalidArgument(f"the field {name!r} was sent {len(values)} times: send it once")
    return values[0] if values else None


def _replicas(form: Form) -> int:
    text = _one(form, "replicas")
    if text is None or not re.fullmatch(r"\s*[0-9]{1,4}\s*", text) or \
            int(text) > MAX_REPLICAS:
        raise InvalidArgument(f"replicas must be a whole number from 0 to {MAX_REPLICAS} "
                              f"(processes per device), got {text!r}")
    return int(text)


def _send(client: Any, queue: str, cmd: str, **fields: Any) -> Done:
    n = publish(client, queue, message(cmd, **fields))
    data = {"queue": queue, "command": cmd, "supervisors": n, **fields}
    if n == 0:
        return Done(f"no supervisor of queue {queue} is listening: nobody received "
                    f"{cmd} and nothing changed; start one ('mtq workers start TARGET -q "
                    f"{queue}'), or check the queue's name", 409, data)
    what = f"scale to {fields['replicas']} per device" if cmd == "scale" else cmd
    return Done(f"{what}: sent to {n} supervisor(s) of queue {queue}", 200, data)


def control(cmd: str) -> Prepare:
    """pause, resume, drain: to every supervisor of the path's queue."""
    def prepare(path: Mapping[str, str], form: Form) -> Act:
        queue = check_queue_name(path.get("queue"))
        return lambda client: _send(client, queue, cmd)
    return prepare


def scale(path: Mapping[str, str], form: Form) -> Act:
    """Processes per device (field ``replicas``, 0 to 256) of the queue's supervisors."""
    queue = check_queue_name(path.get("queue"))
    replicas = _replicas(form)
    return lambda client: _send(client, queue, "scale", replicas=replicas)


def cancel(path: Mapping[str, str], form: Form) -> Act:
    """Cancel the path's task (field ``queue``: where it is; default: look in every
    known queue): a waiting one at once, a running one by its worker."""
    task_id = check_task_id(path.get("task_id"))
    queue = _one(form, "queue") or None
    if queue is not None:
        check_queue_name(queue)

    def act(client: Any) -> Done:
        task = find_task(client, task_id, queue)
        code, before = task.queue.broker.cancel(task.id)
        data = {"id": task.id, "queue": task.queue.name, "was": before}
        if code == 1:
            return Done(f"cancelled task {task.id} (it was {before})", 200,
                        {**data, "outcome": "cancelled"})
        if code == 2:
            return Done(f"cancel requested: task {task.id} is running, its worker stops "
                        "it", 200, {**data, "outcome": "cancel requested"})
        if code == Code.NOT_FOUND:
            raise TaskNotFound(f"no task {task.id!r} in queue {task.queue.name!r}")
        return Done(f"task {task.id} had already ended {before}: nothing to cancel", 409,
                    {**data, "outcome": "finished"})
    return act


def dead(action: str) -> Prepare:
    """retry, purge: the dead letters of the queue named by the ``id`` fields (none:
    all of them)."""
    def prepare(path: Mapping[str, str], form: Form) -> Act:
        queue = check_queue_name(path.get("queue"))
        given = [i for i in form.get("id") or [] if i != ""]
        if len(given) > MAX_IDS:
            raise InvalidArgument(f"at most {MAX_IDS} dead letters at once, got {len(given)}: "
                                  "send fewer ids, or none for all of them")
        ids = [check_task_id(i) for i in given] or None

        def act(client: Any) -> Done:
            q = Queue(queue, client=client)
            n = q.retry_dead(ids) if action == "retry" else q.purge_dead(ids)
            done = "queued again" if action == "retry" else "purged"
            text = f"{n} dead letter(s) of queue {queue} {done}"
            missing = len(ids) - n if ids else 0
            if missing:
                text += f"; {missing} of the ids chosen were not dead letters (any more)"
            return Done(text, 409 if ids and n == 0 else 200,
                        {"queue": queue, "action": action, "count": n,
                         "ids": ids or "all"})
        return act
    return prepare


#: (path under the dashboard's root, the action's name in logs and answers, prepare)
ACTIONS: list[tuple[str, str, Prepare]] = [
    ("/queues/{queue}/pause", "pause", control("pause")),
    ("/queues/{queue}/resume", "resume", control("resume")),
    ("/queues/{queue}/drain", "drain", control("drain")),
    ("/queues/{queue}/scale", "scale", scale),
    ("/tasks/{task_id}/cancel", "cancel", cancel),
    ("/queues/{queue}/dead/retry", "dead-retry", dead("retry")),
    ("/queues/{queue}/dead/purge", "dead-purge", dead("purge")),
]
