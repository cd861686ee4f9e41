"""``mtq rq worker QUEUE...``: serve RQ queues with supervised, batching mtq workers.

The options follow ``rq worker``'s where they mean the same (``--url/-u``, ``--burst/-b``,
``--name/-n``, ``--results-ttl``, ``--worker-ttl``, ``--job-monitoring-interval``,
``--logging_level/-l``, ``--quiet/-q``, ``--with-scheduler/-s``, ``--max-jobs``,
``--max-idle-time``, ``--dequeue-strategy/-ds``, ``--disable-default-exception-handler/-d``,
``--serializer``, ``--path/-P``), plus mtq's own (``--devices``, ``--replicas``,
``--lease-ms``, ``--max-deliveries``, ``--hang-grace``, ``--set``); see docs/rq.md for
what is and is not supported.
"""

from __future__ import annotations

import os
import sys

import click

from mtq.cli.common import EXIT_CODES, USAGE, fail, say

DEFAULT_URL = "redis://localhost:6379/0"


@click.group("rq", epilog=EXIT_CODES)
def rq_group() -> None:
    """Serve RQ queues: jobs that unchanged RQ code enqueued (see docs/rq.md)."""


@rq_group.command("worker", epilog=EXIT_CODES)
@click.argument("queues", nargs=-1, required=True)
@click.option("--url", "-u", default=None,
              help="Redis URL (default: RQ_REDIS_URL, else MTQ_REDIS_URL, else "
                   f"{DEFAULT_URL}, as rq worker).")
@click.option("--burst", "-b", is_flag=True, help="Exit when the queues are empty.")
@click.option("--devices", "devices_spec", default="cpu", show_default=True,
              help="cpu | cuda:0,cuda:1 | all: one set of worker processes per device, "
                   "each pinned with CUDA_VISIBLE_DEVICES.")
@click.option("--replicas", default=1, show_default=True, type=click.IntRange(1, 256),
              help="Worker processes per device.")
@click.option("--name", "-n", default=None, help="RQ worker name (of the processes' prefix).")
@click.option("--max-jobs", default=None, type=click.IntRange(1),
              help="Each worker process exits after this many jobs.")
@click.option("--max-idle-time", default=None, type=click.IntRange(1), metavar="SECONDS",
              help="Each worker process exits once it has had no job for this long.")
@click.option("--dequeue-strategy", "-ds", default="default", show_default=True,
              type=click.Choice(["default", "round_robin", "random"]),
              help="default: the queues in the order given; round_robin: one job from each "
                   "in turn; random: a random order at each claim (as rq worker).")
@click.option("--disable-default-exception-handler", "-d", is_flag=True,
              help="A failed job is not put in RQ's FailedJobRegistry (its status is "
                   "failed all the same), as rq worker -d.")
@click.option("--serializer", "-S", type=click.Choice(["json", "pickle"]), default="json",
              show_default=True,
              help="json: RQ's JSONSerializer; pickled jobs are refused (to the failed job "
                   "registry, saying why). pickle: also run pickled jobs -- unpickling runs "
                   "code chosen by whoever wrote the job, so anyone who can write to this "
                   "Redis can run code on the worker: only if you trust every writer.")
@click.option("--results-ttl", default=None, type=int,
              help="Seconds to keep results (default: RQ's, 500; a job's result_ttl wins).")
@click.option("--worker-ttl", default=None, type=click.IntRange(15),
              help="RQ worker key TTL, seconds (default: RQ's, 420).")
@click.option("--job-monitoring-interval", default=None, type=click.IntRange(1),
              help="Seconds between RQ execution heartbeats' TTL refreshes (default: RQ's, 30).")
@click.option("--lease-ms", default=15_000, show_default=True, type=click.IntRange(300),
              help="mtq's lease of a claimed job, extended every lease/3: a frozen worker's "
                   "jobs go back to the queue after about this long.")
@click.option("--max-deliveries", default=3, show_default=True, type=click.IntRange(1),
              help="A job that was running each time a worker process died this many times "
                   "(a segfault, os._exit, the OOM killer) is failed into RQ's "
                   "FailedJobRegistry instead of going back to the queue.")
@click.option("--hang-grace", "hang_grace_s", default=10.0, show_default=True,
              type=click.FloatRange(0), metavar="SECONDS",
              help="A call still running this long past its jobs' job_timeout (stuck in C "
                   "code, where RQ's SIGALRM cannot stop it) has its process killed and its "
                   "jobs failed with RQ's timeout message.")
@click.option("--with-scheduler", "-s", is_flag=True,
              help="Run RQ's scheduler too (enqueue_at / enqueue_in, Retry intervals).")
@click.option("--set", "sets", multiple=True, metavar="CLASS.KEY=VALUE",
              help="An option of an mtq.Model enqueued by name, CLASS its dotted path as "
                   "enqueued (e.g. --set myapp.models.Embedder.model=/srv/minilm); repeat "
                   "it for each. Checked before any process starts (exit 2).")
@click.option("--path", "-P", "paths", multiple=True, default=["."], show_default=True,
              help="Put this directory first on the import path (repeatable), as rq's -P.")
@click.option("--logging_level", "--logging-level", "-l", "logging_level", default="INFO",
              show_default=True, help="Log level of the worker processes.")
@click.option("--quiet", "-q", is_flag=True, help="Only warnings and errors.")
@click.option("--verbose", "-v", is_flag=True, help="Debug logging.")
def rq_worker(queues: tuple[str, ...], url: str | None, burst: bool, devices_spec: str,
              replicas: int, name: str | None, max_jobs: int | None,
              max_idle_time: int | None, dequeue_strategy: str,
              disable_default_exception_handler: bool, serializer: str,
              results_ttl: int | None, worker_ttl: int | None,
              job_monitoring_interval: int | None, lease_ms: int, max_deliveries: int,
              hang_grace_s: float, with_scheduler: bool, sets: tuple[str, ...],
              paths: tuple[str, ...], logging_level: str, quiet: bool, verbose: bool) -> None:
    """Serve the RQ queues QUEUES (in this order of priority) in supervised worker
    processes: plain job functions one job per call, functions marked with
    @mtq.rq.batched (and mtq.Model classes) in batches. SIGTERM/SIGINT: each process
    finishes its running batch and gives back what it claimed; a second signal kills."""
    try:
        import rq  # noqa: F401
    except ImportError:
        fail("mtq rq worker needs RQ: pip install 'mtq[rq]'", USAGE)
    from mtq.broker.connection import connect, reach
    from mtq.cli.common import code_for
    from mtq.errors import MtqError
    from mtq.rq.supervisor import RQSupervisor
    from mtq.workers.target import add_app_dir

    for p in reversed(paths):
        try:
            add_app_dir(p)
        except MtqError as exc:
            fail(exc, USAGE)
    try:  # the models' options, checked before Redis is reached or a process starts
        from mtq.rq.jobs import model_options

        options = model_options(sets)
    except MtqError as exc:
        fail(exc, USAGE)
    url = url or os.environ.get("RQ_REDIS_URL") or os.environ.get("MTQ_REDIS_URL") or DEFAULT_URL
    level = "DEBUG" if verbose else "WARNING" if quiet else logging_level.upper()
    from mtq.broker.cluster import is_cluster_url, is_sentinel_url

    if is_cluster_url(url) or is_sentinel_url(url):
        # RQ's keys (rq:queue:Q, rq:job:ID, its registries) carry no hash tags: a job
        # and its queue may sit in different slots, which RQ's own transactions forbid
        fail(f"mtq rq worker serves RQ queues on one Redis (redis://, rediss://), not "
             f"{url.split('://', 1)[0]}://: RQ's keys carry no hash tags, so a cluster "
             "cannot hold them, and RQ's producers connect to one server. Give the URL "
             "of the primary (mtq's own queues do run on a cluster: docs/scaling.md)", USAGE)
    try:
        limit = float(os.environ.get("MTQ_REDIS_WAIT_S") or 10)
        reach(connect(url), url, say, timeout_s=limit)
    except MtqError as exc:
        fail(exc, code_for(exc))
    except ValueError as exc:
        fail(f"bad Redis URL {url!r}: {exc}", USAGE)
    worker: dict[str, object] = {"accept_pickle": serializer == "pickle", "lease_ms": lease_ms}
    if options:
        worker["model_options"] = options
    if disable_default_exception_handler:
        worker["disable_default_exception_handler"] = True
    if results_ttl is not None:
        worker["default_result_ttl"] = results_ttl
    if worker_ttl is not None:
        worker["worker_ttl"] = worker_ttl
    if job_monitoring_interval is not None:
        worker["job_monitoring_interval"] = job_monitoring_interval
    try:
        sup = RQSupervisor(list(queues), url, devices_spec=devices_spec, replicas=replicas,
                           name=name, burst=burst, max_jobs=max_jobs,
                           with_scheduler=with_scheduler, max_idle_time=max_idle_time,
                           dequeue_strategy=dequeue_strategy, log_level=level, worker=worker,
                           max_deliveries=max_deliveries, hang_grace_s=hang_grace_s,
                           on_event=say)
    except MtqError as exc:
        fail(exc, USAGE)
    if serializer == "pickle":
        say("--serializer pickle: pickled jobs run; anyone who can write to this Redis can "
            "run code in these processes")
    sys.exit(sup.run())
