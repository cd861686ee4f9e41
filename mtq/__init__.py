"""mtq, a Redis-backed task queue for AI inference.

FIFO order per stream, fair round robin across streams, batched claims and acks,
leases with fencing tokens, and nothing lost when a worker dies.
"""

from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

from mtq.broker.consumer import Consumer, Outcome
from mtq.broker.protocol import Claimed
from mtq.client.chains import Chain, Step
from mtq.client.group import Group
from mtq.client.queue import Queue
from mtq.client.records import Request, TaskInfo
from mtq.client.replies.events import Event
from mtq.client.task import Task
from mtq.errors import (
    BadRequest,
    BrokerError,
    ChainError,
    ChainFailed,
    ConfigError,
    DeviceOutOfMemory,
    DuplicateTask,
    EncodeError,
    GatewayUnprotected,
    HostFileError,
    InvalidName,
    LeaseLost,
    MtqError,
    NotDurable,
    OptionError,
    PayloadError,
    PayloadTooLarge,
    PermanentError,
    QueueFull,
    QueueInUse,
    RateLimited,
    RedisAuthError,
    RedisTLSError,
    RedisUnavailable,
    ResultTimeout,
    ServerNotFound,
    TargetError,
    TaskCancelled,
    TaskFailed,
    TaskNotFound,
    TaskTimeout,
    WouldMissDeadline,
)
from mtq.settings import QueueSettings, RedisSettings
from mtq.workers.batching import Costed
from mtq.workers.current import CurrentTask, current_task
from mtq.workers.generator import Generation, Generator
from mtq.workers.model import Model, Progress
from mtq.workers.options import Option

if _TYPE_CHECKING:
    from mtq.workers.local import Local

__version__ = "0.1.0"


def local(target: _Any, replicas: int = 1, **options: _Any) -> "Local":
    """Serve ``target`` (``"package.module:attr"``, or a function or ``Model`` worker
    processes can import by name) with ``replicas`` processes per device, on a Redis
    of its own, for the length of a ``with`` (or ``async with``) block, which gets a
    :class:`Queue` bound to it; leaving the block stops everything it started. The
    options are :class:`mtq.workers.local.Local`'s (docs/workers.md, "Local mode")."""
    from mtq.workers.local import Local  # (subprocess and friends: on first use)

    return Local(target, replicas, **options)


_MORE_ERRORS = frozenset({"BatchArityError", "BatchShapeError", "EngineTimeout",
                          "InvalidApiKey", "InvalidArgument", "JobRefused", "LocalError", "NoEngine",
                          "ResultNotStorable", "ScheduleError", "TaskFinished",
                          "UsageError"})


def __getattr__(name: str) -> object:
    """``mtq.rq`` (``@mtq.rq.batched`` for RQ job modules) without an explicit import,
    loaded on first use (it imports no part of the rq package itself); likewise
    ``mtq.replies`` and ``mtq.group``, which ``import mtq`` alone has always made
    reachable (``mtq.replies.INBOX_MAX = ...``)."""
    import importlib

    if name == "rq":
        return importlib.import_module("mtq.rq")
    if name == "replies":
        return importlib.import_module("mtq.replies")
    if name == "group":
        return importlib.import_module("mtq.group")
    if name in _MORE_ERRORS:  # in mtq.errors' tree, not in __all__
        from mtq import errors

        return getattr(errors, name)
    raise AttributeError(f"module 'mtq' has no attribute {name!r}")

__all__ = [
    "BadRequest",
    "BrokerError",
    "Chain",
    "ChainError",
    "ChainFailed",
    "Claimed",
    "ConfigError",
    "Consumer",
    "Costed",
    "CurrentTask",
    "DeviceOutOfMemory",
    "DuplicateTask",
    "EncodeError",
    "Event",
    "GatewayUnprotected",
    "Generation",
    "Generator",
    "Group",
    "HostFileError",
    "InvalidName",
    "LeaseLost",
    "Model",
    "MtqError",
    "NotDurable",
    "Option",
    "OptionError",
    "Outcome",
    "PayloadError",
    "PayloadTooLarge",
    "PermanentError",
    "Progress",
    "Queue",
    "QueueFull",
    "QueueInUse",
    "RateLimited",
    "RedisAuthError",
    "RedisTLSError",
    "RedisUnavailable",
    "QueueSettings",
    "RedisSettings",
    "Request",
    "Step",
    "ResultTimeout",
    "ServerNotFound",
    "TargetError",
    "Task",
    "TaskCancelled",
    "TaskFailed",
    "TaskInfo",
    "TaskNotFound",
    "TaskTimeout",
    "WouldMissDeadline",
    "current_task",
    "__version__",
    "local",
]
