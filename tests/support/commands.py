"""Redis commands per task on the hot path, counted by the server (INFO commandstats):
what a test compares between two queues to show a feature adds no command."""

from __future__ import annotations

from collections.abc import Callable

import redis

import mtq
from mtq.broker.consumer import Consumer
from mtq.broker.outcomes import Outcome


def commands_per_task(url: str, name: str, prepare: Callable[[mtq.Queue], object]) -> float:
    """Redis commands (those the scripts run included) per task for 40 tasks on 8
    streams submitted, claimed and acked on queue ``name``, after ``prepare(queue)``
    and a warm-up task (claimed and acked with what ``prepare`` made claimable)."""
    r = redis.Redis.from_url(url)
    try:
        q = mtq.Queue(name, client=r)
        c = Consumer(name, url)
        prepare(q)
        q.submit("warm")
        c.settle([Outcome(t, True, t.id) for t in c.claim(8)])
        r.config_resetstat()
        for i in range(40):
            q.submit(i, stream=f"s{i % 8}")
        n = 0
        while n < 40:
            got = c.claim(8)
            assert got, "the tasks are claimable"
            n += len(got)
            c.settle([Outcome(t, True, t.id) for t in got])
        stats = r.info("commandstats")
        skip = {"cmdstat_info", "cmdstat_config|resetstat"}
        return sum(v["calls"] for k, v in stats.items() if k not in skip) / 40
    finally:
        mtq.replies.hub_of(r).close_all()
        r.close()
