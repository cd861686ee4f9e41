"""The table of targets: every figure a benchmark judges, in one place.

A benchmark reads its targets from here and reports each as met or not in its block of
docs/benchmarks.md; the doc's prose says where a target comes from.
"""

from __future__ import annotations

# -- broker (benchmarks/broker.py) ---------------------------------------------------------
SUBMIT_MANY = 50_000           # tasks/s, submit_many
MEMORY_BEYOND = 300            # bytes per waiting task beyond its encoded payload
SCALE_RATIO = 1.25             # claim cost, 100,000 streams against 10 or 100: within 1.25x

# -- hot path (benchmarks/hotpath.py): (figure, target) ------------------------------------
HOTPATH = {
    "cmds_drain": "<= 4",
    "cmds_rt": "<= 8",
    "cpu_us": "<= 8 us",
    "steady": ">= 40,000",
    "with_startup": ">= 15,000",
    "startup_s": "<= 0.2",
    "rt_ms": "<= 0.5 / <= 1.0",
    "load_p99_ms": "<= 2 ms",
}

# -- batching (benchmarks/batching.py) -----------------------------------------------------
CEILING = 0.90                 # worker throughput / the model called directly, batch 32
GAIN = 5.0                     # batch 32 / batch 1, through the queue
OVERHEAD_MS = 1.0              # the queue's own cost per batch

# -- models (benchmarks/hf_embed.py, run by benchmarks/models.py) ------------------------
HF_EMBEDDER = 0.95             # hf:Embedder through the queue / the model called directly, batch 32

# -- streaming (benchmarks/streaming.py) ---------------------------------------------------
TOKEN_LATENCY_MS = (0.5, 2.0)  # token latency p50, p99
DELIVERED = 0.95               # delivered / raw decode rate
CONTINUOUS = 1.5               # continuous / static tokens/s

# -- web (benchmarks/web.py) ---------------------------------------------------------------
SSE_ADDED_MS = (1.0, 5.0)      # SSE arrival - in-process arrival, p50 and p99

# -- gateway (benchmarks/gateway.py) -------------------------------------------------------
GATEWAY_ADDED_MS = (1.0, 5.0)  # mtq serve stream arrival - in-process arrival, p50 and p99

# -- faults (benchmarks/faults.py) ---------------------------------------------------------
SUPERVISED_P99_S = 1.0         # kill -9 under a supervisor -> claimed again
BARE_P99_S = 10.0              # kill -9 of a bare worker (lease 8 s) -> claimed again
POISON_KEPT = 0.90             # good-task throughput kept with poison tasks

# -- RQ (benchmarks/rq.py) -----------------------------------------------------------------
RQ_NOOP_RATIO = 10.0           # mtq rq worker / rq SimpleWorker, no-op jobs
RQ_CEILING = 0.90              # mtq rq worker / the model's own batch-32 rate

# -- cache (benchmarks/cache.py) -----------------------------------------------------------
CACHE_HIT_P50_MS = 0.3
CACHE_SLOWDOWN = 0.03          # drain with the cache on, all misses
CACHE_INSTRUCTIONS = 0.03      # redis-server instructions per drained task, cache on

# -- observability (benchmarks/observability.py) -------------------------------------------
METRICS_SLOWDOWN = 0.03        # metrics on: at most 3 % slower than off
SCRAPE_MS = 100.0              # a scrape of 1,000 queues

# -- scaling (benchmarks/scaling.py) -------------------------------------------------------
CLUSTER_INSTRUCTIONS = 0.10    # a cluster node's instructions per task against one server
SHARD_SPREAD = 0.20            # queues over primaries: within 20 % of even

# -- scheduling (benchmarks/scheduling.py) -------------------------------------------------
FAIR_SHARE = 0.10              # served cost A:B in every window: within 10 % of the weights'
WEIGHTS_31 = (3.0, 1.0)        # the weighted case: tenant_weights "A=3,B=1"
INTERACTIVE_RTT = 1            # interactive p99 queue wait <= one batch time + this many
                               # claim round trips
BATCH_LOST = 0.05              # batch throughput lost beyond the interactive work itself
SCHED_INSTRUCTIONS = 1.15      # redis-server instructions per drained task, scheduling on/off
SCHED_ROUND_TRIP = 1.10        # round trip p50, scheduling on / off
SCHED_RATE = 0.05              # a tenant's rate limit: observed rate within 5 % of it
SCHED_REFUSAL_P99_MS = 2.0     # ... a refused submit answered within this, p99
SCHED_ON_TIME = 0.99           # 2x overload with deadlines: admitted tasks started in time

# -- engines (benchmarks/engines.py) -------------------------------------------------------
ENGINE_P99 = 1.2               # fast model's p99 latency and time to first token with a slow
                               # engine busy in its process / alone in its own process
