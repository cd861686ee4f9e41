"""The outlet's paced pipe reader (mtq.workers.outlet._PacedReader), on a real pipe."""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest

from mtq.workers.outlet import _PacedReader

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    r, w = os.pipe()
    yield r, w
    for fd in (r, w):
        try:
            os.close(fd)
        except OSError:
            pass


def drain(reader: _PacedReader) -> tuple[queue.SimpleQueue[Any], threading.Thread]:
    """Iterate ``reader`` in a thread; every message (then "EOF") lands in the queue."""
    got: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def run() -> None:
        for msg in reader:
            got.put(msg)
        got.put("EOF")

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return got, t


def test_messages_split_across_writes_arrive_whole_and_in_order(pipe: tuple[int, int]) -> None:
    r, w = pipe
    reader = _PacedReader(r)
    reader.pace_s = 0.001
    data = b"".join(msgpack.packb(["settle", [[f"t{i}", "tok", i, "x" * i, True]], []])
                    for i in range(200))
    got, t = drain(reader)
    for k in range(0, len(data), 7):  # frames cut anywhere, written one piece at a time
        os.write(w, data[k:k + 7])
    os.close(w)
    msgs = [got.get(timeout=10) for _ in range(201)]
    t.join(10)
    assert msgs[-1] == "EOF"
    assert [m[1][0][2] for m in msgs[:-1]] == list(range(200))


def test_after_finding_the_pipe_empty_it_waits_for_the_next_write(
        pipe: tuple[int, int]) -> None:
    r, w = pipe
    reader = _PacedReader(r)
    reader.pace_s = 0.001  # paced: after each read it pauses, then finds the pipe empty
    got, t = drain(reader)
    os.write(w, msgpack.packb(["a"]))
    assert got.get(timeout=10) == ["a"]
    # nothing comes for a while: the reader is blocked on the pipe, not gone
    with pytest.raises(queue.Empty):
        got.get(timeout=0.2)
    assert t.is_alive()
    os.write(w, msgpack.packb(["b"]))  # the write alone wakes it
    assert got.get(timeout=10) == ["b"]
    os.close(w)
    assert got.get(timeout=10) == "EOF"
    t.join(10)
    assert not t.is_alive()


def test_unpaced_it_reads_as_data_comes(pipe: tuple[int, int]) -> None:
    r, w = pipe
    reader = _PacedReader(r)  # pace_s 0 (before the hello): a blocking read each time
    got, t = drain(reader)
    for i in range(50):
        os.write(w, msgpack.packb(["m", i]))
        assert got.get(timeout=10) == ["m", i]
    os.close(w)
    assert got.get(timeout=10) == "EOF"
    t.join(10)
