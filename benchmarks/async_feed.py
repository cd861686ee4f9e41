#!/usr/bin/env python
"""The asyncio reader's feed alone: CPU per item handed to 500 waiting readers.

    python -m benchmarks.async_feed          # ~5 s, prints only

500 readers each wait for their next item with a time limit (15 s, a stream's
keep-alive), and every step hands each of them one item at once, as the reply
subscription does for 500 token streams (``put_all``, one call through the loop).
Compared: ``mtq.client.replies.feeds.AsyncFeed`` (a future per wait, one lazily
moved timer per feed) and the same reader over an ``asyncio.Queue`` read through
``asyncio.wait_for`` (what ``AsyncFeed`` did before: a task and a timer per item).
No Redis; one process; median of 5 runs.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from mtq.client.replies.feeds import AsyncFeed, put_all

READERS, STEPS, LIMIT_S = 500, 200, 15.0


class QueueFeed:
    """A reader's items in an ``asyncio.Queue``, waited for with ``wait_for``."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue()

    async def get(self, timeout: float | None) -> Any:
        if not self.queue.empty():
            return self.queue.get_nowait()
        try:
            return await asyncio.wait_for(self.queue.get(), timeout)
        except asyncio.TimeoutError:
            return None


async def _run(make: Any) -> float:
    feeds = [make() for _ in range(READERS)]

    async def reader(feed: Any) -> None:
        for _ in range(STEPS):
            await feed.get(LIMIT_S)

    readers = [asyncio.ensure_future(reader(f)) for f in feeds]
    await asyncio.sleep(0.01)  # every reader waits
    start = time.process_time()
    for step in range(STEPS):
        items: Any = [(f.queue, step) for f in feeds]  # (an asyncio.Queue takes them too)
        put_all(items)
        while any(f.queue.qsize() if isinstance(f, QueueFeed) else f.queue.items
                  for f in feeds):
            await asyncio.sleep(0)  # every reader takes its item before the next step
    await asyncio.gather(*readers)
    return (time.process_time() - start) / (READERS * STEPS) * 1e6


def main(argv: Sequence[str] | None = None) -> int:
    loop_feed = lambda: AsyncFeed(("q", "t"), asyncio.get_running_loop())  # noqa: E731
    for name, make in (("asyncio.Queue + wait_for", QueueFeed), ("AsyncFeed", loop_feed)):
        runs = [asyncio.run(_run(make)) for _ in range(5)]
        print(f"{name:26s} {statistics.median(runs):6.2f} us CPU per item "
              f"({min(runs):.2f}-{max(runs):.2f} over 5 runs of {READERS} readers x "
              f"{STEPS} items)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
