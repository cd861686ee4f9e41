"""Chains: the hand-off of a succeeded step's result to the next step's queue.

A chain (``Queue.submit(..., then=[...])``, docs/streaming.md, "Chains") is a series of
tasks, each on a queue of its own. Every step's hash holds ``chain`` (msgpack: the
chain's id, which is its first task's id, the step's index and every step's queue) and,
while steps follow it, ``then`` (msgpack: those steps' specs, below). A step's id is
derived from the chain id and its index (:func:`step_id`), so a second submit of it is
refused as a duplicate id: the hand-off is idempotent.

Exactly once, on a Redis Cluster too: ack.lua cannot submit to another queue (another
hash slot), so in the call that ends the step succeeded it records the pending
hand-off in the step's own queue (``mtq:{q}:handoffs``, id -> ms) and answers code 3.
The worker then submits the next step (:func:`hand_off`) and removes the record; a
worker killed between the two leaves the record, which the periodic reaper of any
worker of the queue completes once it is a lease old (:func:`recover`). Two hand-offs
racing (a slow worker and a recoverer) submit one task: the second is a duplicate id.

A stream's order across steps: the ack does not release the step's stream; it stays
held (busy, as if the step still ran) until its record is removed (handed.lua, through
:meth:`HandOff.complete`), which releases it once, whoever removes it. So the stream's
next task cannot run, end and hand off before this one's hand-off went in: the next
queue gets a stream's steps in the order they were submitted. A refused hand-off (next
queue full) holds the stream until it goes through: backpressure.

A step's spec (a dict, msgpack; built and checked by ``mtq.client.chains``): ``q`` its
queue, ``p`` the base payload (None: none), ``f`` the field the previous result goes
under (None: the payload is the previous result), ``k`` the key of a dict result to
take (None: all of it), ``s`` stream, ``t`` tenant, ``b`` band letter, ``l`` ttl ms,
``o`` run timeout ms, ``y`` retries, ``d`` deadline (unix ms: past it, the step
expires unrun). Everything is data: no code travels.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import msgpack

from mtq import serialization
from mtq.broker import scripts
from mtq.broker.cluster import for_queue, sharded, shared
from mtq.broker.codes import Code
from mtq.broker.config import SettingsSource
from mtq.broker.connection import redis_errors
from mtq.broker.keys import QueueKeys
from mtq.broker.protocol import Broker
from mtq.broker.records import NewTask
from mtq.errors import BrokerError, MtqError

log = logging.getLogger(__name__)

#: most steps in a chain (its first task included)
MAX_STEPS = 16
#: the longest id a chain's first task may have: its steps' ids add "-<index>"
MAX_CHAIN_ID = 61
#: ack.lua's code for "recorded; a chain hand-off is pending"
CHAINED = 3
#: a submit's answers that refuse the whole call for now: the record stays
REFUSED = (Code.QUEUE_FULL, Code.RATE_LIMITED, Code.WOULD_MISS)
#: what ack.lua answers for a task whose hand-off it recorded, with the result the
#: worker sent: its ``then``, ``chain``, ``reply`` (None: none) and result
Known = tuple[bytes | None, bytes | None, bytes | None, bytes]
#: records older than this many leases are completed by the reaper (the worker that
#: acked is taken to be dead)
RECOVER_AFTER_LEASES = 1.0
#: most records one recovery round completes
RECOVER_BATCH = 100


class BuildError(MtqError):
    """The next step cannot be submitted: its payload cannot be built from the previous
    result (a ``pick`` key the result lacks, a result too large; ``status`` failed), or
    its deadline passed (``status`` expired: never run). Recorded on the previous step
    (``chainerr``, and ``chainend`` its status); the chain's reader raises it as
    ChainFailed."""

    def __init__(self, message: str, status: str = "failed") -> None:
        super().__init__(message)
        self.status = status


def step_id(chain_id: str, index: int) -> str:
    """The id of step ``index`` (0: the chain's first task, whose id is the chain's)."""
    return chain_id if index == 0 else f"{chain_id}-{index}"


def info(chain_id: str, index: int, queues: list[str]) -> bytes:
    """A step's ``chain`` field."""
    return serialization.dumps({"c": chain_id, "i": index, "q": queues})


def read_info(raw: bytes) -> tuple[str, int, list[str]]:
    """(chain id, step index, every step's queue) of a ``chain`` field."""
    d = serialization.loads(raw)
    return str(d["c"]), int(d["i"]), [str(q) for q in d["q"]]


def build(step: dict[str, Any], result: bytes) -> Any:
    """The payload of ``step`` from the previous step's encoded result. Raises
    BuildError."""
    value = serialization.loads(result)
    pick = step.get("k")
    if pick is not None:
        if not isinstance(value, dict) or pick not in value:
            got = f"keys {sorted(map(str, value))[:10]}" if isinstance(value, dict) \
                else type(value).__name__
            raise BuildError(f"step {step['q']!r} picks key {pick!r} of the previous "
                             f"result, which has none ({got}): make the step before "
                             "return a dict with that key, or change the step's pick=")
        value = value[pick]
    field = step.get("f")
    if field is None:
        return value
    base = dict(step.get("p") or {})
    base[field] = value
    return base


def _replies(reply: bytes | None, src: QueueKeys, dst: QueueKeys) -> str:
    """The reply channels of the previous step (its submitter's and its watchers'),
    moved to the next step's queue: whoever follows the chain hears every step."""
    if not reply:
        return ""
    head = src.reply("")
    out = []
    for ch in reply.decode().split():
        if ch.startswith(head):
            out.append(dst.reply(ch[len(head):]))
    return " ".join(out)


def _refused_for(answer: list[Any], items: list[tuple[str, NewTask]]
                 ) -> list[tuple[str, NewTask]]:
    """The steps of a refused call that the refusal is about: a rate-limited tenant's
    steps, the one step that would miss its deadline, every step for a full queue (or
    a refusal that names none of them)."""
    what = answer[2] if len(answer) > 2 else None
    what = what.decode() if isinstance(what, bytes) else str(what)
    if answer[0] == Code.RATE_LIMITED:
        named = [item for item in items if item[1].tenant == what]
    elif answer[0] == Code.WOULD_MISS:
        named = [item for item in items if item[1].id == what]
    else:
        named = []
    return named or items


class HandOff:
    """Submits the next steps of the chained tasks one worker's acks recorded."""

    def __init__(self, client: Any, queue: str) -> None:
        self.client = shared(client)
        self.keys = QueueKeys(queue)
        self.redis = for_queue(self.client, queue)
        self._brokers: dict[str, Broker] = {}

    def broker(self, queue: str) -> Broker:
        b = self._brokers.get(queue)
        if b is None:
            c = for_queue(self.client, queue)
            b = self._brokers[queue] = Broker(c, queue, SettingsSource.shared(c, queue, None))
        return b

    def run(self, ids: list[str], known: dict[str, Known] | None = None) -> int:
        """Submit the next step of each succeeded task ``ids`` whose hand-off is
        recorded, and remove the records; returns how many were completed. ``known``:
        what ack.lua answered for some of them (their ``then``, ``chain``, ``reply``,
        and the result the worker sent), which saves reading them. A step a queue
        refuses for now (full, rate limited) keeps its record for the next try
        (:func:`recover`); a call refused for one tenant's limit or one step's deadline
        is made again without the steps the refusal names, so the others go in. One
        round trip per next queue (and per such refusal), one to read what is not
        known, and one to remove the records."""
        rows: dict[str, tuple[bytes | None, ...]] = dict(known or {})
        missing = [tid for tid in ids if tid not in rows]
        if missing:
            fields = ("then", "chain", "reply", "result", "chainstop")
            with redis_errors("while reading a chain's next step"):
                pipe = self.redis.pipeline(transaction=False)
                for tid in missing:
                    pipe.hmget(self.keys.task(tid), fields)
                rows.update(zip(missing, (tuple(r) for r in pipe.execute())))
        done: list[str] = []
        refused: list[str] = []  # records kept: their next queue refused them for now
        groups: dict[tuple[str, str], list[tuple[str, NewTask]]] = {}
        for tid in ids:
            then, chain, reply, result, *more = rows[tid]
            if then is None or chain is None or result is None:
                if then is None and chain is None and result is None:
                    log.warning("chain hand-off after %s dropped: the task is gone (its "
                                "retention ran out) before its next step could be "
                                "submitted", tid)
                done.append(tid)  # gone, or not chained
            elif more and more[0] is not None:  # its chain was cancelled
                self._tell(chain, then, reply, "cancelled", "the chain was cancelled")
                done.append(tid)
            else:
                try:
                    queue, new = self._next(then, chain, result)
                except BrokerError as exc:  # its queue's settings unreadable: later
                    log.warning("chain step after %s: cannot read its queue (%s); retried "
                                "a lease later", tid, exc)
                    refused.append(tid)
                    continue
                except BuildError as exc:
                    log.warning("chain step after %s: %s", tid, exc)
                    with redis_errors():
                        self.redis.hset(self.keys.task(tid), mapping={
                            "chainerr": str(exc), "chainend": exc.status})
                    self._tell(chain, then, reply, exc.status, str(exc))
                    done.append(tid)
                    continue
                replies = _replies(reply, self.keys, QueueKeys(queue))
                groups.setdefault((queue, replies), []).append((tid, new))
        submitted: list[tuple[str, str, str]] = []  # (task, its next step, next queue)
        pending = list(groups.items())
        while pending:
            (queue, replies), items = pending.pop(0)
            b, tasks = self.broker(queue), [new for _, new in items]
            unconfirmed = False
            try:
                if b.settings.durable_replicas:  # as a client's submit to it would
                    answer, acks = b.submit_durable(tasks, replies)
                    # not confirmed: the record stays, so a step a failover lost is
                    # submitted again (a later try that finds it there, a duplicate id,
                    # is done)
                    unconfirmed = 0 <= acks < b.settings.durable_replicas
                else:
                    answer = b.submit(tasks, replies)
            except BrokerError as exc:  # that queue's node away, a user denied it: the
                # other queues' steps go on, and these records go to the back
                log.warning("chain steps %s: cannot submit to queue %r (%s); retried a "
                            "lease later", [n.id for _, n in items], queue, exc)
                refused += [tid for tid, _ in items]
                continue
            if answer and answer[0] in REFUSED:  # the call's: nothing went in
                out = _refused_for(answer, items)
                log.info("chain steps %s: queue %r refused them for now (code %s); "
                         "retried a lease later", [n.id for _, n in out], queue,
                         answer[0])
                refused += [tid for tid, _ in out]
                if len(out) < len(items):  # the others again, without those it named
                    named = {id(item) for item in out}
                    pending.insert(0, ((queue, replies),
                                       [item for item in items if id(item) not in named]))
                continue
            if unconfirmed:
                log.info("chain steps %s: queue %r's replicas did not confirm them; "
                         "their records stay", [n.id for _, n in items], queue)
            for (tid, new), got in zip(items, answer):
                # its id, or DUPLICATE_ID: a hand-off raced this one (or an unconfirmed
                # try wrote it, and it is still there on the primary that serves now)
                (refused if unconfirmed and got == new.id else done).append(tid)
                if got == new.id:
                    submitted.append((tid, new.id, queue))
        if refused:
            self._later(refused)
        if done or submitted:
            stops = self.complete(done, [tid for tid, _, _ in submitted])
            for (_, nxt, queue), stop in zip(submitted, stops):
                if stop:  # the chain was cancelled while its next step was submitted
                    self.broker(queue).cancel(nxt)
        return len(done)

    def complete(self, done: Sequence[str], look: Sequence[str] = ()) -> list[bool]:
        """Remove the records ``done`` (their hand-offs are complete) and release the
        streams their acks held, each once however many completers race (handed.lua);
        returns, for each of ``look``, whether its chain was cancelled (``chainstop``).
        One round trip."""
        call = scripts.Call(scripts.script("handed"), self.keys.script_keys,
                            [*self.keys.channels, len(done), *done, *look],
                            lambda r: [bool(int(x)) for x in r[2:]])
        with redis_errors("while removing chain hand-off records"):
            return list(scripts.run(self.redis, call)[0])

    def sweep(self) -> int:
        """Release the streams held for records that are gone (handed.lua's sweep);
        returns how many holds it dropped."""
        call = scripts.Call(scripts.script("handed"), self.keys.script_keys,
                            [*self.keys.channels, -1], lambda r: int(r[0]))
        with redis_errors("while sweeping chain hand-off holds"):
            dropped = int(scripts.run(self.redis, call)[0])
        if dropped:
            log.warning("chain hand-offs: %d stream(s) held for a record that is gone "
                        "(removed without handed.lua) released", dropped)
        return dropped

    def _later(self, ids: list[str]) -> None:
        """Score the records ``ids`` now (server time; those still there): the reaper
        tries them again a lease later, and takes the others before them."""
        with redis_errors("while putting back refused chain hand-offs"):
            sec, usec = self.redis.time()
            now = sec * 1000 + usec // 1000
            self.redis.zadd(self.keys.handoffs, dict.fromkeys(ids, now), xx=True)

    def _tell(self, chain: bytes, then: bytes, reply: bytes | None, status: str,
              error: str) -> None:
        """Tell whoever follows the chain that its next step will never run, as that
        step's done message would (status, error): its reader's wait ends now. The
        record on the previous step (``chainstop``, ``chainerr``) is what a later
        reader reads."""
        try:
            chain_id, index, queues = read_info(chain)
            queue = queues[index + 1]
        except (LookupError, TypeError, ValueError):  # (PayloadError too) unreadable
            return
        channels = _replies(reply, self.keys, QueueKeys(queue))
        if not channels:
            return
        nxt = step_id(chain_id, index + 1)
        msg = msgpack.packb(["done", int(time.time() * 1e6), [nxt, status, error.encode()]])
        c = for_queue(self.client, queue)
        try:
            with redis_errors():
                for ch in channels.split():
                    if sharded(c):
                        c.spublish(ch, msg)
                    else:
                        c.publish(ch, msg)
        except MtqError as exc:  # the reader finds the record when it looks
            log.info("could not tell the chain's readers (%s)", exc)

    def _next(self, then: bytes, chain: bytes, result: bytes) -> tuple[str, NewTask]:
        """The next step's queue and task, its payload built from ``result``. Raises
        BuildError (a record that cannot be read too: it never will be), BrokerError."""
        try:
            return self._build_next(then, chain, result)
        except (BuildError, BrokerError):
            raise
        except Exception as exc:  # a corrupt field, a spec of another version, bad settings
            raise BuildError(f"the chain's next step cannot be read from its record "
                             f"({type(exc).__name__}: {exc}); the chain stops here: are "
                             "all its clients and workers of one mtq version?") from exc

    def _build_next(self, then: bytes, chain: bytes, result: bytes) -> tuple[str, NewTask]:
        chain_id, index, queues = read_info(chain)
        steps = serialization.loads(then)
        step, rest = steps[0], steps[1:]
        nxt = index + 1
        payload = serialization.dumps(build(step, result))
        b = self.broker(step["q"])
        if len(payload) > b.settings.max_payload_bytes:
            raise BuildError(f"the payload built for step {nxt} ({step['q']!r}) is "
                             f"{len(payload)} bytes, over its queue's max_payload_bytes")
        ttl_ms = step.get("l") or 0
        if step.get("d"):
            left = int(step["d"] - time.time() * 1000)
            if left <= 0:  # (a task submitted with it would be handed to a worker at once)
                raise BuildError(f"step {nxt} ({step['q']!r}) was due to start by its "
                                 f"deadline, {-left} ms ago", "expired")
            ttl_ms = min(ttl_ms, left) if ttl_ms else left
        return step["q"], NewTask(
            id=step_id(chain_id, nxt), payload=payload, stream=step.get("s") or "",
            ttl_ms=ttl_ms, retries=step.get("y"), band=step.get("b") or "s",
            tenant=step.get("t") or "", timeout_ms=step.get("o") or 0,
            chain=info(chain_id, nxt, queues),
            then=serialization.dumps(rest) if rest else b"")


def recover(h: HandOff, lease_ms: int) -> int:
    """Complete hand-offs recorded more than a lease ago (the worker that acked died
    before it submitted the next step): one round trip when there are none. Also the
    sweep: more streams held than records means a record went without handed.lua
    (an operator's ZREM or DEL of the records), its stream held with nothing
    left to release it: :meth:`HandOff.sweep` releases it. (A hold without its record
    while other records are there is found once they are gone.)"""
    with redis_errors("while reading chain hand-offs"):
        pipe = h.redis.pipeline(transaction=False)
        pipe.time()
        pipe.zrange(h.keys.handoffs, 0, RECOVER_BATCH - 1, withscores=True)
        pipe.hlen(h.keys.held)
        pipe.zcard(h.keys.handoffs)
        (sec, usec), rows, holds, records = pipe.execute()
    if holds > records:
        h.sweep()
    if not rows:
        return 0
    now = sec * 1000 + usec // 1000
    due = [m.decode() for m, score in rows if score <= now - lease_ms * RECOVER_AFTER_LEASES]
    return h.run(due) if due else 0
