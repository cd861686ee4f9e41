"""An asyncio reader's feed (mtq.client.replies.feeds.AsyncFeed): items in order, a
wait's time limit kept exactly by its one lazily moved timer, on a real event loop."""

from __future__ import annotations

import asyncio
import time

from mtq.client.replies.feeds import AsyncFeed, AsyncOneShot, put_all


def _run(coro_fn):  # type: ignore[no-untyped-def]
    return asyncio.run(coro_fn())


def test_items_come_in_order_and_a_quiet_wait_ends_at_its_limit() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        feed = AsyncFeed(("q", "t"), loop)
        feed.push("a")
        loop.call_soon(put_all, [(feed.queue, "b")])  # as the hub does, after "a"
        await asyncio.sleep(0)
        assert [await feed.get(1), await feed.get(1)] == ["a", "b"]
        assert await feed.get(0) is None  # nothing there: no wait at all
        start = time.monotonic()
        assert await feed.get(0.05) is None
        assert 0.05 <= time.monotonic() - start < 1.0
        loop.call_later(0.02, feed.push, "c")
        start = time.monotonic()
        assert await feed.get(10) == "c"
        assert time.monotonic() - start < 1.0  # woken by the item, not the limit
        feed.close()
        assert feed.timer is None

    _run(main)


def test_a_later_limit_is_kept_by_the_earlier_timer_firing_again() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        feed = AsyncFeed(("q", "t"), loop)
        loop.call_later(0.01, feed.push, "x")
        assert await feed.get(0.05) == "x"  # its timer (due at 0.05) stays set
        start = time.monotonic()
        assert await feed.get(0.2) is None   # the old timer fires first: not the end
        waited = time.monotonic() - start
        assert 0.2 <= waited < 1.0, waited

    _run(main)


def test_an_earlier_limit_gets_a_timer_of_its_own() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        feed = AsyncFeed(("q", "t"), loop)
        loop.call_later(0.01, feed.push, "x")
        assert await feed.get(30) == "x"    # a timer 30 s out
        start = time.monotonic()
        assert await feed.get(0.05) is None  # must end at 0.05 s, not 30
        assert time.monotonic() - start < 1.0
        feed.close()

    _run(main)


def test_a_wait_without_limit_is_not_ended_by_an_old_timer() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        feed = AsyncFeed(("q", "t"), loop)
        loop.call_later(0.01, feed.push, "x")
        assert await feed.get(0.05) == "x"
        loop.call_later(0.15, feed.push, "y")  # after the old timer's 0.05 s
        start = time.monotonic()
        assert await feed.get(None) == "y"
        assert time.monotonic() - start >= 0.14

    _run(main)


def test_a_cancelled_wait_leaves_its_items() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        feed = AsyncFeed(("q", "t"), loop)
        waiting = asyncio.ensure_future(feed.get(10))
        await asyncio.sleep(0.01)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        assert feed.queue.waiter is None
        feed.push("z")
        await asyncio.sleep(0)
        assert await feed.get(1) == "z"
        feed.close()

    _run(main)


def test_a_one_shot_wait_cancelled_as_its_item_comes_is_cancelled_and_a_timeout_leaves_it() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        one = AsyncOneShot(("q", "t"), loop)
        waiter = asyncio.ensure_future(one.get(30))
        await asyncio.sleep(0)
        one._set("done")
        waiter.cancel()  # in the same turn of the loop as the item
        try:
            await asyncio.wait_for(asyncio.shield(waiter), 5)
        except asyncio.CancelledError:
            pass
        assert waiter.cancelled(), "the cancel was lost: the wait returned the item"
        assert await one.get(1) == "done"
        late = AsyncOneShot(("q", "u"), loop)
        assert await late.get(0.01) is None
        late._set("late")  # a timed-out wait leaves the future to a second one
        assert await late.get(1) == "late"

    _run(main)
