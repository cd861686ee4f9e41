"""The floor of a round trip through Redis and a worker process: BLPOP a request and
RPUSH it back onto the requester's list (redis-py with hiredis, as mtq), no record, no
lease, no event: four commands. ``python -m benchmarks.children.echo URL``; a request
``stop`` ends it."""

from __future__ import annotations

import sys
from typing import Any

import redis


def main(url: str) -> None:
    r = redis.Redis.from_url(url)
    while True:
        got: Any = r.blpop(["bare:in"], timeout=1)  # (redis-py 8 reads with a 5 s socket timeout)
        if got is None:
            continue
        request: bytes = got[1]
        if request == b"stop":
            break
        r.rpush(b"bare:out:" + request, request)


if __name__ == "__main__":
    main(sys.argv[1])
