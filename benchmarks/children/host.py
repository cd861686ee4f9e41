"""A host process for the benchmarks and tests: several engines (workers) in one process.

    python -m benchmarks.children.host CONFIG_JSON

``CONFIG_JSON``: ``{"url": REDIS_URL, "device": "cpu", "max_loaded": N | null,
"memory_budget": BYTES | null, "engines": [{"queue": Q, "target": SPEC, "options":
{...}, "on_demand": false, "idle_unload_s": null, "max_batch_size": null}, ...]}``.

It builds a :class:`~mtq.workers.worker.Worker` per engine and a
:class:`~mtq.workers.host.Host` of them, sets them up, listens on each queue's
control channel (the engine commands: ``{"cmd": "unload", "reply": RID, ...}``,
answered through :mod:`mtq.broker.answers`), and runs until SIGTERM, as ``mtq worker
run`` does for one model. It stands apart from the product's own host file (``mtq
workers start --config``) so that the benchmark measures the engines alone.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any


def build(config: dict[str, Any]) -> Any:
    """The Host of ``config`` (not set up)."""
    from mtq.workers.host import Host
    from mtq.workers.worker import Worker

    workers = [Worker(e["target"], e["queue"], url=config["url"],
                      device=config.get("device", "cpu"),
                      options={k: str(v) for k, v in (e.get("options") or {}).items()},
                      on_demand=bool(e.get("on_demand")), idle_unload_s=e.get("idle_unload_s"),
                      max_batch_size=e.get("max_batch_size"))
               for e in config["engines"]]
    return Host(workers, memory_budget=config.get("memory_budget"),
                max_loaded=config.get("max_loaded"))


def main(argv: list[str]) -> int:
    from mtq.workers.control import Listener
    from mtq.workers.signals import on_stop_signals
    from mtq.workers.worker import Worker

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(threadName)s %(name)s %(message)s")
    config = json.loads(argv[0])
    host = build(config)
    host.setup()
    on_stop_signals(host.stop)
    listeners = [Listener(w.consumer.redis, w.queue, w.command) for w in host.workers]
    for listener in listeners:
        listener.start()
    Worker.freeze_startup()
    try:
        totals = host.run()
    finally:
        for listener in listeners:
            listener.close()
    print(f"host stopped: {totals}; failed: {sorted(host.failed)}", file=sys.stderr, flush=True)
    return 1 if host.failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
