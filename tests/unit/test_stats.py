"""mtq.workers.stats: bucket edges (Prometheus' ``le``), thread safety, and a flush
that forgets its counts only once its pipeline succeeded."""

from __future__ import annotations

import threading

import pytest

from mtq.workers.stats import BOUNDS, SECONDS, TOKENS_PER_S, Histograms


class Pipe:
    """Records what a flush adds, as a redis-py pipeline would queue it."""

    def __init__(self) -> None:
        self.ints: dict[str, int] = {}
        self.floats: dict[str, float] = {}

    def hincrby(self, key: str, field: str, n: int) -> None:
        assert key == "h"
        self.ints[field] = self.ints.get(field, 0) + n

    def hincrbyfloat(self, key: str, field: str, x: float) -> None:
        assert key == "h"
        self.floats[field] = self.floats.get(field, 0.0) + x


def test_bounds_are_the_documented_ones() -> None:
    assert SECONDS[0] == 0.001 and SECONDS[-1] == 300 and len(SECONDS) == 17
    assert TOKENS_PER_S == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
    assert set(BOUNDS) == {"queue_wait", "run", "latency", "ttft", "tokens_per_s", "load"}
    for bounds in BOUNDS.values():
        assert list(bounds) == sorted(set(bounds))


@pytest.mark.parametrize(("value", "bucket"), [
    (0.0, 0), (0.001, 0), (0.0010001, 1), (0.0025, 1), (1.0, 9), (1.5, 10),
    (300.0, 16), (300.1, 17), (1e9, 17),
])
def test_a_value_on_a_bound_falls_in_that_bucket(value: float, bucket: int) -> None:
    h = Histograms()
    h.observe("latency", value)
    counts = h.pending()["latency"]
    assert counts[bucket] == 1 and sum(counts) == 1
    assert len(counts) == len(SECONDS) + 1  # the last one is +Inf


def test_an_unknown_metric_raises_and_disabled_observes_nothing() -> None:
    h = Histograms()
    with pytest.raises(KeyError):
        h.observe("nope", 1.0)
    h.enabled = False
    h.observe("run", 1.0)
    assert not any(any(c) for c in h.pending().values())
    assert h.flush(Pipe(), "h") is None


def test_concurrent_observations_are_all_counted() -> None:
    h = Histograms()
    n, threads = 20_000, 8

    def work(k: int) -> None:
        for i in range(n):
            h.observe("run", (i % 7) * 0.01 + k * 1e-4)

    ts = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert sum(h.pending()["run"]) == n * threads


def test_flush_writes_non_cumulative_buckets_and_the_sum() -> None:
    h = Histograms()
    for v in (0.002, 0.002, 0.7, 400.0):
        h.observe("queue_wait", v)
    h.observe("tokens_per_s", 42.0)
    pipe = Pipe()
    sent = h.flush(pipe, "h")
    assert pipe.ints == {"queue_wait:1": 2, "queue_wait:9": 1, "queue_wait:17": 1,
                         "tokens_per_s:5": 1}
    assert pipe.floats["queue_wait:sum"] == pytest.approx(400.704)
    assert pipe.floats["tokens_per_s:sum"] == 42.0
    assert set(pipe.floats) == {"queue_wait:sum", "tokens_per_s:sum"}  # no empty metric
    h.commit(sent)
    assert h.flush(Pipe(), "h") is None  # nothing left


def test_a_failed_flush_keeps_its_counts_and_a_later_one_sends_them_once() -> None:
    h = Histograms()
    h.observe("run", 0.03)
    failed = Pipe()
    h.flush(failed, "h")  # its pipeline raised: no commit
    h.observe("run", 0.03)  # observed while Redis was away
    pipe = Pipe()
    sent = h.flush(pipe, "h")
    assert pipe.ints == {"run:5": 2}
    assert pipe.floats["run:sum"] == pytest.approx(0.06)
    h.commit(sent)
    assert not any(h.pending()["run"])


def test_observations_between_flush_and_commit_stay_pending() -> None:
    h = Histograms()
    h.observe("ttft", 0.2)
    sent = h.flush(Pipe(), "h")
    h.observe("ttft", 0.2)  # after the pipeline was built, before it returned
    h.commit(sent)
    pipe = Pipe()
    h.commit(h.flush(pipe, "h"))
    assert pipe.ints == {"ttft:7": 1}
    assert pipe.floats["ttft:sum"] == pytest.approx(0.2)


def test_commit_of_nothing_is_a_no_op() -> None:
    h = Histograms()
    h.commit(None)
    assert h.flush(Pipe(), "h") is None


def test_observe_many_counts_as_observe_does() -> None:
    one, many = Histograms(), Histograms()
    values = [0.0005, 0.001, 0.3, 7.0, 1e6]
    for v in values:
        one.observe("run", v)
    many.observe_many("run", values)
    many.observe_many("run", [])
    assert one.pending() == many.pending()
    a, b = Pipe(), Pipe()
    one.flush(a, "h")
    many.flush(b, "h")
    assert a.ints == b.ints and a.floats == pytest.approx(b.floats)
