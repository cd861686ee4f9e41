"""mtq's exceptions, one tree.

::

    MtqError
    ├── ConfigError                 a setting is unknown or out of range
    │   ├── HostFileError           a host file (``--config host.toml``) that cannot be used
    │   ├── GatewayUnprotected      ``mtq serve`` beyond loopback while no API key exists
    │   ├── ScheduleError           a schedule that cannot be added (cron, zone, name taken)
    │   └── ChainError              a chain's steps that cannot be submitted (``then=``)
    ├── BrokerError                 Redis is unreachable or answered unexpectedly
    │   ├── RedisUnavailable        the connection was refused, reset or timed out
    │   ├── RedisAuthError          Redis refused the credentials, or the user lacks a permission
    │   │   └── RedisTLSError       a TLS connection cannot be set up (certificate, port, files)
    │   └── ServerNotFound          no redis-server binary for the embedded default
    ├── InvalidName                 a queue or stream name that is not allowed
    ├── PayloadError                a payload or result that cannot be stored
    │   ├── PayloadTooLarge         bigger than the queue's max_payload_bytes
    │   └── EncodeError             not msgpack-encodable (and never pickled)
    ├── QueueFull                   the queue holds max_length waiting tasks
    ├── RateLimited                 a tenant is over its rate limit (reject mode); retry_after
    ├── WouldMissDeadline           a task would start after its deadline; retry_after
    ├── QueueInUse                  workers serve the queue that was to be deleted
    ├── NotDurable                  queued, but not confirmed by the replicas asked for
    ├── DuplicateTask               a task with this id already exists
    ├── TaskNotFound                no such task (or its retention ran out)
    ├── TaskFailed                  the task ended failed, dead or expired
    │   ├── TaskCancelled           the task was cancelled
    │   └── ChainFailed             a step of a chain did not succeed (.step, .queue, .task_id)
    ├── ResultTimeout               the task did not finish in time (also a TimeoutError)
    │   └── EngineTimeout           engines did not all answer a load/unload/reload/reset in time
    ├── LocalError                  ``mtq.local`` could not start its workers (or not in time)
    ├── NoEngine                    no engine serves the queue (for load/unload/reload/reset)
    ├── LeaseLost                   a worker's lease on a task expired; another owns it
    ├── TargetError                 a worker target (``module:attr``) cannot be loaded
    │   └── OptionError             a model option (``--set``) it does not declare or take
    ├── PermanentError              raised or returned by a model: fail at once, no retry
    │   └── BadRequest              a payload the model cannot take (fails alone)
    ├── DeviceOutOfMemory           a task ran out of device memory on its own (retried)
    ├── TaskTimeout                 a task ran past its run timeout and was stopped (retried)
    ├── InvalidArgument             an argument that is not allowed (a script's, a priority, a cost)
    ├── InvalidApiKey               a gateway API key that is missing, malformed, unknown or revoked
    ├── TaskFinished                the task had already ended: nothing was changed
    ├── BatchShapeError             a model returned the wrong number of results
    ├── BatchArityError             an RQ job of a batched function has other than one argument
    ├── JobRefused                  a job the RQ worker will not run (a pickled job)
    ├── ResultNotStorable           an RQ job's return value its serializer cannot write
    └── UsageError                  a call its object's state does not allow (a closed group)

InvalidArgument, BatchShapeError, OptionError and BadRequest are also ValueErrors;
BatchShapeError, BatchArityError and ResultNotStorable TypeErrors; UsageError a
RuntimeError.
``mtq.broker.codes.error`` is the one place that turns the codes the Lua scripts return
into these exceptions.

Every message says what was wrong and what to do about it.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "UsageError",
    "BadRequest",
    "BatchArityError",
    "BatchShapeError",
    "BrokerError",
    "ChainError",
    "ChainFailed",
    "ConfigError",
    "DeviceOutOfMemory",
    "DuplicateTask",
    "EncodeError",
    "EngineTimeout",
    "GatewayUnprotected",
    "HostFileError",
    "InvalidApiKey",
    "InvalidArgument",
    "InvalidName",
    "JobRefused",
    "LeaseLost",
    "LocalError",
    "MtqError",
    "NoEngine",
    "NotDurable",
    "OptionError",
    "PayloadError",
    "PayloadTooLarge",
    "PermanentError",
    "QueueFull",
    "QueueInUse",
    "RateLimited",
    "RedisAuthError",
    "RedisTLSError",
    "RedisUnavailable",
    "ScheduleError",
    "ResultNotStorable",
    "ResultTimeout",
    "ServerNotFound",
    "TargetError",
    "TaskCancelled",
    "TaskFailed",
    "TaskFinished",
    "TaskNotFound",
    "TaskTimeout",
    "WouldMissDeadline",
]


class MtqError(Exception):
    """Root of every error mtq raises on purpose."""


class ConfigError(MtqError, ValueError):
    """A setting is unknown, misspelled or out of range."""


class HostFileError(ConfigError):
    """A host file (``mtq workers start --config host.toml``) that cannot be used: a
    TOML syntax error, an unknown key, a value of the wrong type or out of range, a
    missing or unknown target, a device this machine does not have. The message
    starts with ``FILE:LINE:``."""


class ChainError(ConfigError):
    """A chain (``submit(..., then=[...])``) that cannot be submitted: a bad step, too
    many steps, an id too long to derive its steps' ids from. Nothing was written."""


class ScheduleError(ConfigError):
    """A schedule (``mtq schedule add``, :func:`mtq.client.schedules.add`, a host file's
    ``[[schedule]]``) that cannot be added: a bad cron expression, an unknown time zone,
    a bad name or catch-up policy, a name already taken. Nothing is written."""


class GatewayUnprotected(ConfigError):
    """``mtq serve`` was asked to listen beyond loopback while no API key exists: anyone
    who can reach the address could use the models. Create a key first (``mtq keys
    create --tenant T``) or listen on 127.0.0.1."""


class BrokerError(MtqError):
    """Redis could not be reached or answered something mtq did not expect."""


class RedisUnavailable(BrokerError):
    """Redis could not be reached: the connection was refused, reset or timed out
    (after mtq's own retries). The operation may or may not have taken effect."""


class RedisAuthError(BrokerError):
    """Redis refused mtq's user or password, or the Redis user may not run a command
    or touch a key mtq needs (ACL). Retrying does not help; the message says what to
    change."""


class RedisTLSError(RedisAuthError):
    """A TLS connection to Redis could not be set up: the server's certificate is not
    trusted (no or the wrong CA file), the port does not speak TLS, or a certificate
    file named in the URL cannot be read. Retrying does not help; the message says
    what to change."""


class ServerNotFound(BrokerError):
    """No ``redis-server`` binary was found for the embedded server."""


class InvalidName(MtqError, ValueError):
    """A queue or stream name that mtq does not accept."""


class PayloadError(MtqError, ValueError):
    """A payload or result that cannot be stored."""


class PayloadTooLarge(PayloadError):
    """The encoded payload is bigger than the queue allows."""


class EncodeError(PayloadError, TypeError):
    """The value is not msgpack-encodable (mtq never falls back to pickle)."""


class QueueFull(MtqError):
    """The queue already holds its maximum number of waiting tasks."""

    def __init__(self, queue: str, waiting: int, max_length: int, adding: int = 1) -> None:
        self.queue, self.waiting, self.max_length = queue, waiting, max_length
        #: tasks of the same submit_many call that went in before the full chunk
        self.created: list[Any] = []
        super().__init__(
            f"queue {queue!r} is full: {waiting} tasks wait and max_length is {max_length}, "
            f"so {adding} more do not fit; retry later, add workers, or raise max_length"
        )


class RateLimited(MtqError):
    """A tenant's tasks were refused: they are over its rate limit (requests or cost per
    minute, ``rate_limit_mode`` reject). Nothing of the call was queued; retry after
    ``retry_after`` seconds. The web helpers answer 429 with ``Retry-After``."""

    def __init__(self, queue: str, tenant: str, retry_after: float) -> None:
        self.queue, self.tenant, self.retry_after = queue, tenant, retry_after
        #: tasks of the same submit_many call that went in before the refused chunk
        self.created: list[Any] = []
        super().__init__(
            f"tenant {tenant!r} is over its rate limit on queue {queue!r}: nothing of this "
            f"submit was queued; retry in {retry_after:.3f} s, or raise its limit "
            "(tenant_rpm, tenant_tpm)")


class WouldMissDeadline(MtqError):
    """A task submitted with a ``deadline`` would start after it (the cost waiting ahead
    of it at the queue's measured service rate), so it was refused at once. Nothing of
    the call was queued; ``retry_after`` seconds is when the backlog ahead should let it
    start in time. The web helpers answer 503 with ``Retry-After``."""

    def __init__(self, queue: str, task_id: str, retry_after: float) -> None:
        self.queue, self.task_id, self.retry_after = queue, task_id, retry_after
        self.created: list[Any] = []
        super().__init__(
            f"task {task_id} would start about {retry_after:.3f} s after its deadline on "
            f"queue {queue!r} (the work ahead of it at the rate the workers serve), so it was "
            "not queued; retry later with a later deadline, or add workers")


class QueueInUse(MtqError):
    """A queue that live workers serve was not deleted (``force`` deletes it anyway)."""

    def __init__(self, queue: str, workers: list[str]) -> None:
        self.queue, self.workers = queue, workers
        shown = ", ".join(workers[:5]) + (" ..." if len(workers) > 5 else "")
        super().__init__(
            f"queue {queue!r} was not deleted: {len(workers)} worker(s) serve it ({shown}); "
            f"stop them first (mtq workers stop -q {queue}), or force it (--force)")


class NotDurable(MtqError):
    """A durable submit (``durable_replicas``) was queued, but fewer replicas than asked
    confirmed it within ``durable_timeout_ms``: a crash of the primary now could lose
    it. The tasks are queued (``created``); submitting them again would duplicate them."""

    def __init__(self, queue: str, acks: int, wanted: int, timeout_ms: int) -> None:
        self.queue, self.acks, self.wanted = queue, acks, wanted
        #: the tasks of the call: all queued (on the primary)
        self.created: list[Any] = []
        super().__init__(
            f"queued on {queue!r}, but only {acks} of the {wanted} replica(s) asked for "
            f"confirmed it within {timeout_ms} ms: it could be lost if the primary crashes "
            "now. The tasks are queued (.created): do not submit them again; check the "
            "replicas (INFO replication), or lower durable_replicas")


class DuplicateTask(MtqError):
    """A task with the given id already exists in the queue.

    ``created`` holds the handles of the tasks of the same call that were
    submitted; ``duplicates`` the refused ids.
    """

    created: list[Any]
    duplicates: list[str]


class TaskNotFound(MtqError, LookupError):
    """No such task: it never existed or its retention time ran out."""


class TaskFailed(MtqError):
    """The task ended in a state other than succeeded.

    ``status`` is the terminal state (failed, dead, expired, cancelled) and
    ``error`` the worker's error text, if any.
    """

    def __init__(self, task_id: str, status: str, error: str | None = None) -> None:
        self.task_id, self.status, self.error = task_id, status, error
        detail = f": {error}" if error else ""
        super().__init__(f"task {task_id} ended {status}{detail}")


class TaskCancelled(TaskFailed):
    """The task was cancelled before it could finish."""


class ChainFailed(TaskFailed):
    """A step of a chain did not succeed, so the chain stopped there: ``step`` (its
    index, 0 the first task), ``queue``, ``task_id`` and ``status`` name it, ``error`` is
    its own error text, and ``cause`` the step's TaskFailed (or TaskCancelled), if it
    ran. No later step was submitted."""

    def __init__(self, step: int, queue: str, task_id: str, status: str,
                 error: str | None = None, cause: TaskFailed | None = None) -> None:
        self.step, self.queue, self.cause = step, queue, cause
        TaskFailed.__init__(self, task_id, status, error)
        detail = f": {error}" if error else ""
        self.args = (f"chain stopped at step {step} (queue {queue!r}, task {task_id}), "
                     f"which ended {status}{detail}",)


class ResultTimeout(MtqError, TimeoutError):
    """The task did not reach a terminal state within the timeout."""

    def __init__(self, task_id: str, timeout: float, status: str) -> None:
        self.task_id, self.timeout, self.status = task_id, timeout, status
        super().__init__(
            f"task {task_id} did not finish within {timeout:g}s (it is {status}, and "
            "goes on); wait longer, check that a worker serves its queue (mtq status), or "
            f"stop it (mtq cancel {task_id})"
        )


class EngineTimeout(ResultTimeout):
    """An engine command (load, unload, reload, reset) was not answered by every engine
    within its timeout. ``answers``: those that came; ``missing``: the registry
    entries of the engines that did not answer (they may still carry it out)."""

    def __init__(self, queue: str, op: str, timeout: float, answers: list[dict[str, Any]],
                 missing: list[dict[str, Any]]) -> None:
        self.queue, self.op, self.answers, self.missing = queue, op, answers, missing
        #: (a ResultTimeout's fields) the command's reply id, its timeout, "running"
        self.task_id, self.timeout, self.status = "", timeout, "running"
        names = ", ".join(f"{w.get('id')} ({w.get('host')}:{w.get('pid')})"
                          for w in missing[:5]) + (" ..." if len(missing) > 5 else "")
        MtqError.__init__(
            self, f"{op} on queue {queue!r}: {len(missing)} engine(s) did not answer within "
            f"{timeout:g}s: {names}; they may still be at it (a model load can take "
            f"minutes: give a longer timeout), or be stuck: see mtq workers list -q {queue}")


class NoEngine(MtqError, LookupError):
    """No live engine serves the queue (or none has the worker id asked for): a load,
    unload, reload or reset has no one to carry it out."""

    def __init__(self, queue: str, worker: str | None = None, detail: str = "") -> None:
        self.queue, self.worker = queue, worker
        if detail:
            text = detail
        elif worker:
            text = (f"no engine of queue {queue!r} has worker id {worker!r}; mtq workers "
                    f"list -q {queue} shows those that serve it")
        else:
            text = (f"no process serves queue {queue!r}: start one with mtq workers start "
                    f"TARGET -q {queue} (or mtq worker run TARGET -q {queue})")
        super().__init__(text)


class LeaseLost(MtqError):
    """This worker's lease on a task expired and the task was reclaimed.

    Its result is discarded: the worker that now owns the task records the outcome.
    (The consumer API reports lost ids in ``SettleReport.lost`` rather than raising;
    worker code that must abort a task raises this.)
    """

    def __init__(self, task_ids: list[str]) -> None:
        self.task_ids = task_ids
        super().__init__(
            f"lease lost on {len(task_ids)} task(s) ({', '.join(task_ids[:5])}...): "
            "they were reclaimed after their lease expired; raise lease_ms if tasks run long"
        )


class LocalError(MtqError):
    """``mtq.local(...)`` could not start: its supervisor stopped (set-up failed again
    and again, its message says why) or its workers were not ready within
    ``ready_timeout`` (:attr:`timed_out` is then True). Nothing it started is left
    running. A target that cannot be served is a :class:`TargetError` instead."""

    def __init__(self, message: str, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class TargetError(MtqError):
    """A worker target (``package.module:attr``) could not be loaded."""


class OptionError(TargetError, ValueError):
    """A model option (``--set KEY=VALUE``, ``set_options``) the target does not
    declare, a value it cannot take, or a required one missing (exit 2)."""


class PermanentError(MtqError):
    """Raise it from ``predict`` (or put an instance in an item's place) when retrying
    cannot help, e.g. a malformed request: the task fails at once, without retries
    and without going to the dead-letter list."""


class BadRequest(PermanentError, ValueError):
    """A payload the model cannot take (a field it does not know, a value out of range,
    a prompt longer than its context): the task fails at once, alone, without retries;
    the message says what to change."""


class DeviceOutOfMemory(MtqError):
    """A task ran out of memory on its own, in a call on it alone: the error its worker
    records for it (``DeviceOutOfMemory: ...``, with the model's own error, a CUDA, MPS or
    host out-of-memory error, after it). A batch that runs out of memory is split and
    its halves run, so the tasks that fit are not charged for it; the one that does not
    fit even alone fails with this, and is retried like any failure (alone) until its
    retries run out. It asks for more memory than the device has free: ask for less (a
    shorter input, fewer tokens), lower what the model keeps per request, or serve it
    on a device with more memory."""

    def __init__(self, error: BaseException | str) -> None:
        self.error = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        super().__init__(
            f"the task ran out of memory on its own, in a batch of one ({self.error}); it "
            "needs more memory than the device has free: ask for less (a shorter input, "
            "fewer tokens), lower the model's memory per request, or serve it on a device "
            "with more memory")


class TaskTimeout(MtqError):
    """A task ran past its run timeout (``submit(..., timeout=S)``, or the queue's
    ``task_timeout_s``), measured from when its predict call or generator step started
    running it, and was stopped: the error its worker records for it (``TaskTimeout:
    ...``). Retried like any failure until its retries run out. Raised inside a worker by
    ``mtq.current_task().raise_if_cancelled()`` once every task of the running call is
    past its time. Give the task a longer timeout, or make it do less."""

    def __init__(self, timeout_s: float | None = None, detail: str = "") -> None:
        self.timeout_s = timeout_s
        what = f"its timeout of {timeout_s:g} s" if timeout_s else "its timeout"
        super().__init__(detail or f"the task ran past {what} and was stopped; give it a "
                                   "longer timeout (submit's timeout=, the queue's "
                                   "task_timeout_s) or make it do less")


class InvalidArgument(MtqError, ValueError):
    """A Lua script refused an argument: an unknown action (a dead-letter action other
    than retry or purge), or a token index past the next one. Nothing was changed."""


class InvalidApiKey(MtqError):
    """An API key the gateway cannot accept (:mod:`mtq.client.apikeys`): none was sent, it
    is not an mtq key, no key has its id and secret, or it was revoked. ``reason`` is
    ``missing``, ``malformed``, ``unknown`` or ``revoked``; ``key_id`` the id the token
    names, when it names one. The message never holds the secret."""

    def __init__(self, reason: str, key_id: str | None = None) -> None:
        self.reason = reason
        self.key_id = key_id
        ask = "ask the gateway's operator for a key ('mtq keys create --tenant T' makes one)"
        text = {
            "missing": "no API key was sent: send one as 'Authorization: Bearer mtq-...'; "
                       + ask,
            "malformed": "this is not an mtq API key (they read mtq-<12 hex digits>-<43 "
                         "characters>): check that it was copied whole; else " + ask,
            "unknown": f"API key {key_id} is not known, or its secret is wrong: check "
                       "that the whole key was copied; else " + ask,
            "revoked": f"API key {key_id} was revoked: " + ask.replace("a key", "a new key"),
        }.get(reason, f"API key refused ({reason}): " + ask)
        super().__init__(text)


class TaskFinished(MtqError):
    """The task had already reached a terminal state (``status``), so the operation
    (a cancel) changed nothing."""

    def __init__(self, task_id: str, status: str) -> None:
        self.task_id, self.status = task_id, status
        super().__init__(f"task {task_id} already ended {status}; nothing was changed")


class BatchShapeError(MtqError, ValueError, TypeError):
    """A model's predict (or a generator's prefill or decode) returned the wrong number
    of results for its batch, or not a list: the batch's tasks fail with it."""


class BatchArityError(MtqError, TypeError):
    """A job of a batched function was enqueued with other than one positional argument."""


class JobRefused(MtqError):
    """A job that the RQ worker will not run (see ``mtq.rq.jobs.PICKLE_REFUSED``)."""


class ResultNotStorable(MtqError, TypeError):
    """A job's return value cannot be written with the job's serializer."""


class UsageError(MtqError, RuntimeError):
    """A call its object's state does not allow: adding to a closed group, a Flask
    helper on an app ``MTQ(app)`` has not set up. The message says what to call first."""
