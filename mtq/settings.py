"""Settings: small frozen dataclasses, built explicitly, that reject unknown keys.

Environment variables are read only by the ``from_env`` constructors (called by
the CLI and by :func:`mtq.broker.connection.connect` when no URL is given), never
at import time.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from mtq.errors import ConfigError, InvalidArgument
from mtq.validation import check_cost, check_tenant

T = TypeVar("T")


def _build(cls: type[T], values: Mapping[str, Any]) -> T:
    known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(
            f"unknown {cls.__name__} setting(s) {', '.join(unknown)}; "
            f"known settings are {', '.join(sorted(known))}"
        )
    return cls(**values)


@dataclass(frozen=True)
class RedisSettings:
    """Where Redis is. ``url=None`` means the embedded server (see mtq.broker.embedded)."""

    url: str | None = None
    socket_timeout: float = 30.0
    connect_timeout: float = 5.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RedisSettings:
        """Read ``MTQ_REDIS_URL`` (empty or unset: the embedded server)."""
        env = os.environ if environ is None else environ
        return cls(url=env.get("MTQ_REDIS_URL") or None)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> RedisSettings:
        """Build from a mapping; unknown keys raise ConfigError."""
        return _build(cls, values)


#: the largest value of a count setting: exact in Lua (a double) and in Redis
_MAX_COUNT = 2**53 - 1
_YEARS_30_S = 30 * 365 * 24 * 3600
#: most retries a queue or a task may ask for
MAX_RETRIES = 10_000
#: most latencies a queue keeps (LATENCY_KEEP in mtq/broker/lua/_lib.lua)
LATENCY_MAX = 1000
#: the largest values Redis takes where they end up (EXPIRE, PEXPIRE, a string's size)
_MAXIMUMS = {
    "max_payload_bytes": 512 * 1024 * 1024,
    "lease_ms": _YEARS_30_S * 1000, "retry_backoff_ms": _YEARS_30_S * 1000,
    "retry_backoff_max_ms": _YEARS_30_S * 1000, "durable_timeout_ms": _YEARS_30_S * 1000,
    "retention_s": _YEARS_30_S, "dead_retention_s": _YEARS_30_S,
    "idempotency_window_s": _YEARS_30_S, "cache_ttl_s": _YEARS_30_S, "max_retries": MAX_RETRIES, "durable_replicas": 100,
    "band_min_share": 99, "latency_keep": LATENCY_MAX, "diagnostics_ttl_s": _YEARS_30_S,
    "batch_log_bytes": 1 << 30,
}


@dataclass(frozen=True)
class QueueSettings:
    """Behaviour of one queue, shared by its producers and its workers.

    Raises ConfigError for unknown keys (``from_dict``) and out-of-range values.
    """

    #: waiting tasks beyond which submit raises QueueFull (0: unbounded)
    max_length: int = 0
    #: largest encoded payload accepted by submit, in bytes
    max_payload_bytes: int = 8 * 1024 * 1024
    #: how long a claimed task stays leased without a heartbeat. Workers extend their
    #: leases every second (or every lease/3, if shorter), so a worker can stall 7 s
    #: before it loses one; a bare worker that dies has its tasks back within ~8 s
    #: (a supervised one at once). Raise it if a process may freeze longer.
    lease_ms: int = 8_000
    #: a task whose lease expired on this many deliveries is dead (poison)
    max_deliveries: int = 5
    #: retries after a handler error, unless the task sets its own
    max_retries: int = 3
    #: first retry delay; doubles per attempt, with jitter, up to retry_backoff_max_ms
    retry_backoff_ms: int = 500
    retry_backoff_max_ms: int = 60_000
    #: what happens when retries run out: dead-letter (True) or plain failed (False)
    dead_letter: bool = True
    #: how long finished tasks (and their results) are kept
    retention_s: int = 3600
    #: how long dead-lettered tasks are kept, and how many at most
    dead_retention_s: int = 7 * 24 * 3600
    dead_max: int = 10_000
    #: how long an idempotency key maps to its task
    idempotency_window_s: int = 3600
    #: most wake-up markers kept for sleeping workers
    wake_cap: int = 64
    #: most expired leases / due retries handled per claim call
    reap_limit: int = 100
    #: a submit is acknowledged only once this many replicas have it (Redis WAIT in the
    #: same round trip), so a crash of the primary host cannot lose it; 0: once the
    #: primary has it (with appendfsync everysec, a host crash may lose the last second)
    durable_replicas: int = 0
    #: how long a durable submit waits for its replicas before it raises NotDurable
    durable_timeout_ms: int = 1000
    #: workers keep histograms (queue wait, run time, latency, tokens) for the
    #: metrics exporter, aggregated in the process and written once per heartbeat
    metrics: bool = True
    #: result cache: how long a succeeded result answers identical requests (0: off)
    cache_ttl_s: int = 0
    #: most results the cache keeps (the soonest to expire go first)
    cache_max_entries: int = 10_000
    #: scheduling (docs/scheduling.md): each tenant's weight in the fair share of the
    #: served cost, "tenant=weight,..." (a mapping is taken too); a tenant not named has 1
    tenant_weights: str = ""
    #: the cost of a task that gives none (and whose payload says no max_tokens)
    default_cost: float = 1.0
    #: percent of the claimed cost a lower priority band with waiting work is owed while
    #: higher bands have work too (0: strict priority, a lower band may starve)
    band_min_share: int = 5
    #: rate limits per tenant, requests and cost per minute, "tenant=N,...": "*=N" is
    #: every tenant not named (tasks without a tenant have none); global across every
    #: producer and worker
    tenant_rpm: str = ""
    tenant_tpm: str = ""
    #: what a submit over a limit gets: "reject" (RateLimited, HTTP 429) or "hold" (it
    #: is queued, and claims pass its tenant over until its limit allows)
    rate_limit_mode: str = "reject"
    #: diagnostics (docs/operations.md): the batch log (what `mtq trace` reads) keeps at
    #: most this many records and this many bytes of them (the newest)
    batch_log_max: int = 10_000
    batch_log_bytes: int = 512 * 1024
    #: latencies kept for the queue's p50/p99 (the newest; at most 1,000)
    latency_keep: int = 1000
    #: the queue's diagnostics (batch log, latencies, failures, histograms) are deleted
    #: once no worker wrote to them for this long
    diagnostics_ttl_s: int = 24 * 3600
    #: how long a task may run once started, in seconds, unless it gives its own
    #: (``submit(..., timeout=S)``): past it, it is stopped and fails with TaskTimeout
    #: (retried under its retry policy); 0: no limit
    task_timeout_s: float = 0.0
    #: a supervisor kills a process whose running call's every task was cancelled or
    #: timed out, if that call still runs this many seconds later (docs/workers.md)
    cancel_grace_s: float = 5.0

    def __post_init__(self) -> None:
        if isinstance(self.tenant_weights, Mapping):
            object.__setattr__(self, "tenant_weights", format_weights(self.tenant_weights))
        if isinstance(self.default_cost, int) and not isinstance(self.default_cost, bool):
            object.__setattr__(self, "default_cost", float(self.default_cost))
        if not isinstance(self.tenant_weights, str):
            raise ConfigError(f"tenant_weights takes 'tenant=weight,...' or a mapping, got "
                              f"{self.tenant_weights!r}")
        parse_weights(self.tenant_weights)
        for name in ("tenant_rpm", "tenant_tpm"):
            value = getattr(self, name)
            if isinstance(value, Mapping):
                object.__setattr__(self, name, format_limits(value, name))
            elif not isinstance(value, str):
                raise ConfigError(f"{name} takes 'tenant=N,...,*=N' or a mapping, got {value!r}")
            parse_limits(getattr(self, name), name)
        if self.rate_limit_mode not in ("reject", "hold"):
            raise ConfigError(f"rate_limit_mode takes reject or hold, got "
                              f"{self.rate_limit_mode!r}")
        for name in ("task_timeout_s", "cancel_grace_s"):
            value = getattr(self, name)
            if isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, name, float(value))
                value = float(value)
            if not isinstance(value, float) or not 0 <= value <= _YEARS_30_S:
                raise ConfigError(f"{name} must be a number of seconds in [0, {_YEARS_30_S}] "
                                  f"(0: {'no limit' if name == 'task_timeout_s' else 'at once'}"
                                  f"), got {value!r}")
        if not isinstance(self.default_cost, float):
            raise ConfigError(f"default_cost must be a number, got {self.default_cost!r}")
        try:
            check_cost(self.default_cost, "default_cost")
        except InvalidArgument as exc:
            raise ConfigError(str(exc)) from None
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in ("int", int) and (not isinstance(value, int) or isinstance(value, bool)):
                raise ConfigError(f"{f.name} must be an integer, got {value!r}")
            if f.type in ("bool", bool) and not isinstance(value, bool):
                raise ConfigError(f"{f.name} must be True or False, got {value!r}")
        minimums = {
            "max_length": 0, "max_payload_bytes": 1, "lease_ms": 1, "max_deliveries": 1,
            "max_retries": 0, "retry_backoff_ms": 0, "retry_backoff_max_ms": 0,
            "retention_s": 1, "dead_retention_s": 1, "dead_max": 1,
            "idempotency_window_s": 1, "wake_cap": 1, "reap_limit": 1,
            "durable_replicas": 0, "durable_timeout_ms": 1, "cache_ttl_s": 0,
            "cache_max_entries": 1, "band_min_share": 0, "batch_log_max": 0,
            "batch_log_bytes": 0, "latency_keep": 1, "diagnostics_ttl_s": 1,
        }
        for name, low in minimums.items():
            high = _MAXIMUMS.get(name, _MAX_COUNT)
            if not low <= getattr(self, name) <= high:
                raise ConfigError(f"{name} must be in [{low}, {high}], got "
                                  f"{getattr(self, name)}")

    @property
    def weights(self) -> dict[str, float]:
        """``tenant_weights`` as a mapping."""
        return parse_weights(self.tenant_weights)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> QueueSettings:
        """Build from a mapping; unknown keys raise ConfigError."""
        return _build(cls, values)

    def replace(self, **changes: Any) -> QueueSettings:
        """A copy with some settings changed; unknown keys raise ConfigError."""
        _build(QueueSettings, changes) if changes else None
        return dataclasses.replace(self, **changes)


def parse_weights(text: str) -> dict[str, float]:
    """Tenant weights from their text, ``"acme=3,beta=0.5"`` ('' : none). Raises
    ConfigError naming what is wrong: a tenant name, or a weight that is not a finite
    number above 0."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        tenant, sep, value = part.partition("=")
        try:
            if not sep:
                raise InvalidArgument(f"{part!r} is not tenant=weight")
            check_tenant(tenant.strip())
            out[tenant.strip()] = check_cost(float(value), f"the weight of {tenant.strip()}",
                                             zero=False)
        except ValueError as exc:  # InvalidName, InvalidArgument, float()
            raise ConfigError(f"tenant_weights: {exc}; write it as "
                              "'acme=3,beta=0.5' (weights above 0)") from None
    return out


def parse_limits(text: str, name: str = "tenant_rpm") -> dict[str, float]:
    """Rate limits per minute from their text, ``"acme=600,*=60"`` ('*': every tenant not
    named). Raises ConfigError for a bad tenant name or a limit that is not a finite
    number above 0 (a limit of 0 would refuse everything: remove the tenant instead)."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        tenant, sep, value = part.partition("=")
        tenant = tenant.strip()
        try:
            if not sep:
                raise InvalidArgument(f"{part!r} is not tenant=limit")
            if tenant != "*":
                check_tenant(tenant)
            out[tenant] = check_cost(float(value), f"the limit of {tenant}", zero=False)
        except ValueError as exc:
            raise ConfigError(f"{name}: {exc}; write it as 'acme=600,*=60' (per minute, "
                              "above 0)") from None
    return out


def format_limits(limits: Mapping[str, Any], name: str = "tenant_rpm") -> str:
    """The text of a mapping of rate limits (checked as :func:`parse_limits` does)."""
    text = ",".join(f"{t}={v!r}" if isinstance(v, float) else f"{t}={v}"
                    for t, v in sorted(limits.items()))
    parse_limits(text, name)
    return text


def format_weights(weights: Mapping[str, Any]) -> str:
    """The text of a mapping of tenant weights (checked as :func:`parse_weights` does)."""
    text = ",".join(f"{t}={w!r}" if isinstance(w, float) else f"{t}={w}"
                    for t, w in sorted(weights.items()))
    parse_weights(text)
    return text


#: every queue setting: (unit, what it does), for ``mtq queue config`` and docs/cli.md
#: (a test checks that the docs list each with its default and unit)
QUEUE_SETTING_DOCS: dict[str, tuple[str, str]] = {
    "max_length": ("tasks", "waiting tasks beyond which a submit raises QueueFull (0: no limit)"),
    "max_payload_bytes": ("bytes", "largest encoded payload a submit accepts"),
    "lease_ms": ("ms", "how long a claimed task stays leased without a heartbeat (workers "
                       "extend it every second); a bare worker's death costs this long"),
    "max_deliveries": ("deliveries", "a task whose lease expired this many times is dead "
                                     "(poison)"),
    "max_retries": ("retries", "retries after a handler error, unless the task sets its own"),
    "retry_backoff_ms": ("ms", "first retry delay; doubles per attempt, with jitter"),
    "retry_backoff_max_ms": ("ms", "longest retry delay"),
    "dead_letter": ("true/false", "when retries run out: dead-letter (true) or failed (false)"),
    "retention_s": ("s", "how long finished tasks and their results are kept"),
    "dead_retention_s": ("s", "how long dead letters are kept"),
    "dead_max": ("tasks", "most dead letters kept (the oldest go first)"),
    "idempotency_window_s": ("s", "how long an idempotency key maps to its task"),
    "wake_cap": ("markers", "most wake-up markers kept for sleeping workers"),
    "reap_limit": ("tasks", "most expired leases or due retries handled per claim"),
    "durable_replicas": ("replicas", "a submit is acknowledged, and a worker's claim and "
                                     "ack count, once this many replicas have it (0: once "
                                     "the primary has it)"),
    "durable_timeout_ms": ("ms", "how long a durable submit waits for its replicas before it "
                                 "raises NotDurable"),
    "metrics": ("true/false", "workers keep histograms for `mtq metrics serve` (queue wait, "
                              "run time, latency, tokens)"),
    "cache_ttl_s": ("s", "result cache: how long a result answers identical requests "
                         "(0: no cache)"),
    "cache_max_entries": ("results", "most results the cache keeps"),
    "tenant_weights": ("tenant=weight,...", "each tenant's weight in the fair share of the "
                                            "served cost; a tenant not named has 1"),
    "default_cost": ("cost", "the cost of a task that gives none (nor max_tokens)"),
    "band_min_share": ("percent", "share of the claimed cost a lower priority band with "
                                  "waiting work is owed (0: strict priority)"),
    "tenant_rpm": ("tenant=N,...", "requests per minute each tenant may start ('*': every "
                                   "tenant not named)"),
    "tenant_tpm": ("tenant=N,...", "cost (tokens) per minute each tenant may start"),
    "rate_limit_mode": ("reject/hold", "a submit over a limit is refused (RateLimited, "
                                       "429) or held until its limit allows"),
    "batch_log_max": ("records", "most batch records kept for `mtq trace` (0: none)"),
    "batch_log_bytes": ("bytes", "most bytes of batch records kept (0: none)"),
    "latency_keep": ("tasks", f"latencies kept for p50/p99 (at most {LATENCY_MAX})"),
    "diagnostics_ttl_s": ("s", "the batch log, latencies, failures and histograms are "
                               "deleted once no worker wrote to them for this long"),
    "task_timeout_s": ("s", "how long a task may run once started unless it gives its own "
                            "timeout; past it, it fails with TaskTimeout (0: no limit)"),
    "cancel_grace_s": ("s", "a supervisor kills a process whose running call was wholly "
                            "cancelled or timed out if it still runs this long after"),
}
