"""Every Redis key and channel name mtq uses is built here and nowhere else.

All keys of one queue share the hash tag ``{queue}`` so each Lua script touches a
single Redis Cluster slot. Queue names are validated before they reach this module
(:func:`mtq.validation.check_queue_name`), so they cannot contain braces or
whitespace and cannot escape their key space.
"""

from __future__ import annotations

PREFIX = "mtq"

#: the set of known queue names (outside any queue's slot; never touched by Lua)
QUEUES = f"{PREFIX}:queues"
#: the worker registry: sorted set of worker id -> last heartbeat (ms)
WORKERS = f"{PREFIX}:workers"
#: the model catalogue's history: list of JSON records (loaded, reloaded, reload_failed,
#: stopped), newest first, trimmed to a fixed length; kept after workers stop
MODELS_HISTORY = f"{PREFIX}:models:history"
#: the gateway's API keys: the set of every key id (revoked ones too; outside any slot)
API_KEYS = f"{PREFIX}:apikeys"


def api_key(key_id: str) -> str:
    """The hash of one API key (:mod:`mtq.client.apikeys`): its record and the SHA-256 of
    its secret, never the secret. Its own hash tag, shared with :func:`api_key_rate`."""
    return f"{PREFIX}:apikey:{{{key_id}}}"


def api_key_rate(key_id: str) -> str:
    """One API key's rate limits' state (hash: ``r``, ``c`` -> when its next request,
    its next token, is due; ms), expiring once the key has been idle a minute."""
    return f"{PREFIX}:apikey:{{{key_id}}}:rate"


def dashboard_session(digest: str) -> str:
    """One web dashboard session (hash: ``key``, the admin key's id; ``csrf``, its forms'
    token; ``created``), named by the SHA-256 of the session id its cookie holds (never
    the id itself), expiring with the session. Its own hash tag."""
    return f"{PREFIX}:dashboard:session:{{{digest}}}"


def hub(client_id: str) -> str:
    """A client's own channel: its reply listener subscribes to it first, and is poked
    on it to subscribe to further queues."""
    return f"{PREFIX}:hub:{client_id}"


def worker(worker_id: str) -> str:
    """The hash one worker process reports its health in (expires when it stops beating)."""
    return f"{PREFIX}:worker:{worker_id}"


def rq_lease(queue: str, part: str) -> str:
    """A key of ``mtq rq worker``'s lease index over the RQ queue ``queue``
    (:mod:`mtq.rq.leases`): ``part`` is ``leases``, ``owner``, ``token`` or
    ``deliveries``. RQ's own keys (``rq:queue:<name>``, ``rq:job:<id>``, ...) are
    RQ's; the bridge names them in :mod:`mtq.rq.leases`."""
    return f"{PREFIX}:rq:{{{queue}}}:{part}"


class QueueKeys:
    """Key and channel names of one queue.

    ``script_keys`` is the KEYS vector every Lua script receives, in the order
    documented at the top of ``lua/_lib.lua``.
    """

    __slots__ = (
        "base",
        "batches",
        "busy",
        "cache_index",
        "cache_prefix",
        "channels",
        "config",
        "control",
        "dead",
        "delayed",
        "events",
        "failures",
        "free",
        "handoffs",
        "held",
        "hist",
        "idem_prefix",
        "idle",
        "latency",
        "leases",
        "model",
        "out_prefix",
        "queue",
        "ready",
        "sched",
        "script_keys",
        "seq",
        "stats",
        "stream_prefix",
        "task_prefix",
        "trace_prefix",
        "wake",
    )

    def __init__(self, queue: str) -> None:
        self.queue = queue
        self.base = f"{PREFIX}:{{{queue}}}:"
        self.task_prefix = self.base + "task:"
        self.stream_prefix = self.base + "stream:"
        self.ready = self.base + "ready"
        self.busy = self.base + "busy"
        self.leases = self.base + "leases"
        self.delayed = self.base + "delayed"
        self.dead = self.base + "dead"
        self.wake = self.base + "wake"
        self.stats = self.base + "stats"
        self.free = self.base + "free"
        self.idem_prefix = self.base + "idem:"
        self.seq = self.base + "seq"
        self.events = self.base + "events"
        self.out_prefix = self.base + "out:"
        self.trace_prefix = self.base + "trace:"
        self.latency = self.base + "latency"
        self.failures = self.base + "failures"
        self.control = self.base + "control"
        #: the queue's stored settings (see mtq.broker.config)
        self.config = self.base + "config"
        #: the result cache: entries (+ model version + ":" + payload digest) and an
        #: index of them (zset: entry key -> expiry ms) that bounds their number
        self.cache_prefix = self.base + "cache:"
        self.cache_index = self.base + "cachex"
        #: the model the queue's workers serve now (hash: target, version,
        #: deterministic, loaded); the cache's keys carry its version
        self.model = self.base + "model"
        #: histogram buckets the workers aggregate (hash: "<metric>:<bucket>" -> count,
        #: "<metric>:sum" -> seconds; see mtq.observe.prometheus)
        self.hist = self.base + "hist"
        #: recent batches, newest first (list: one record per batch a worker ran; what
        #: `mtq trace` reads)
        self.batches = self.base + "batches"
        #: workers asleep with room for a batch (hash: worker id -> "expiry ms|lease
        #: ms|room"): a submit hands new tasks to one of them directly (see submit.lua)
        self.idle = self.base + "idle"
        #: scheduling's keys (lanes, tenants' virtual times, served cost: see _lib.lua
        #: and docs/scheduling.md) are this prefix and a suffix
        self.sched = self.base + "sched:"
        #: chains (docs/streaming.md, "Chains"): id of a succeeded chained task whose next
        #: step is still to be submitted -> when it succeeded (ms, server time)
        self.handoffs = self.base + "handoffs"
        #: the streams held for those pending hand-offs (hash: id -> stream; K_HELD in
        #: the scripts, which derive it from the handoffs key)
        self.held = self.handoffs + ":streams"
        self.script_keys = [
            self.task_prefix, self.stream_prefix, self.ready, self.busy, self.leases,
            self.delayed, self.dead, self.wake, self.stats, self.free, self.idem_prefix,
            self.seq, self.out_prefix, self.trace_prefix, self.latency, self.failures,
            self.cache_prefix, self.cache_index, self.model, self.idle, self.sched,
            self.handoffs,
        ]
        #: ARGV[1] and ARGV[2] of every script
        self.channels = [self.events, self.control]

    @property
    def sched_count(self) -> str:
        """Scheduling's per-lane counts (hash: '<b>:<t>|w', '|c', '|r', '|h', '|x';
        see _lib.lua, "Scheduling")."""
        return self.sched + "count"

    @property
    def sched_served(self) -> str:
        """Scheduling's cost served per lane (hash: '<b>:<t>' -> cost)."""
        return self.sched + "served"

    def task(self, task_id: str) -> str:
        """The hash of one task."""
        return self.task_prefix + task_id

    def stream(self, stream: str) -> str:
        """The list of one stream's waiting task ids."""
        return self.stream_prefix + stream

    def idem(self, key: str) -> str:
        """The idempotency key record."""
        return self.idem_prefix + key

    def worker_wake(self, worker_id: str) -> str:
        """A worker's own wake list: pushed to by its own threads to end its BLPOP."""
        return self.base + "wake:" + worker_id

    def worker_inbox(self, worker_id: str) -> str:
        """A worker's inbox: tasks a submit handed to it while it slept (see submit.lua),
        each entry one msgpack claim reply."""
        return self.idle + ":" + worker_id

    def trace(self, task_id: str) -> str:
        """The list of a task's life events ("ms|kind|detail"), oldest first."""
        return self.trace_prefix + task_id

    def out(self, task_id: str) -> str:
        """The list of a task's streamed tokens (chunks), by index: what a late
        subscriber replays."""
        return self.out_prefix + task_id

    def viewers(self, task_id: str) -> str:
        """How many event streams of a task web servers opened (mtq.contrib.sse's
        cancel grace: a stream that left cancels only if no newer one opened)."""
        return self.base + "viewers:" + task_id

    def reply(self, client_id: str) -> str:
        """A client's reply channel on this queue: every event of the tasks it submitted
        (queued, started, tokens, progress, restarted, done). It carries the queue's
        hash tag, so a script may publish to it on a sharded-pub/sub cluster."""
        return self.base + "reply:" + client_id
