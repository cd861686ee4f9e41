"""A queue's backlog, in tasks and in cost, from what one scrape reads
(:mod:`mtq.broker.scrape`): the exporter's ``mtq_queue_backlog_tasks`` and
``mtq_queue_backlog_cost`` (docs/scaling.md).

In tasks: waiting (the stats hash's ``waiting``, kept by the scripts) + running
(the leases) + delayed tasks already due (a retry or delayed submit no claim has
queued yet: with no worker up, nobody queues them, so they must count to wake one).

In cost: with scheduling on (docs/scheduling.md), the cost of the waiting tasks
is exact (the lanes' ``|c`` in ``sched:count``); a running task's cost is not kept
once claimed, so each counts at the mean cost of the waiting ones (1 when none
waits), as does a due delayed task. Without scheduling every task costs 1, and the
cost is the count.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["backlog"]


def backlog(waiting: int, running: int, due: int,
            sched_count: Mapping[Any, Any]) -> tuple[int, float]:
    """(tasks, cost) of one queue; ``sched_count``: its ``sched:count`` hash (empty
    without scheduling)."""
    tasks = max(waiting, 0) + running + due
    if not sched_count:
        return tasks, float(tasks)
    lane_waiting, lane_cost = 0, 0.0
    for key, value in sched_count.items():
        k = key.decode() if isinstance(key, bytes) else str(key)
        field, _, kind = k.rpartition("|")
        if ":" not in field:  # a band total ('<b>|c'), not a lane
            continue
        if kind == "w":
            lane_waiting += max(int(float(value)), 0)
        elif kind == "c":
            lane_cost += max(float(value), 0.0)
    mean = lane_cost / lane_waiting if lane_waiting else 1.0
    return tasks, lane_cost + max(tasks - lane_waiting, 0) * mean
