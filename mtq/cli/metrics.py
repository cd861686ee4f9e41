"""``mtq metrics serve``: the Prometheus exporter of :mod:`mtq.observe.prometheus`."""

from __future__ import annotations

import signal
import sys
from types import FrameType

import click

from mtq.cli.common import NOT_FOUND, USAGE, fail, redis_option, running_server, say
from mtq.errors import MtqError


@click.group("metrics")
def metrics_group() -> None:
    """Export the queues' counters to Prometheus."""


@metrics_group.command("serve")
@click.option("--port", default=9808, show_default=True, type=click.IntRange(0, 65535),
              help="Port to listen on (0: any free port, printed at start).")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0: every interface).")
@click.option("-q", "--queue", "queues", multiple=True,
              help="Export only this queue (repeat for more; default: every known queue, "
                   "re-read at each scrape).")
@click.option("--tenant-top", default=20, show_default=True, type=click.IntRange(0, 1000),
              help="Per queue, the tenants (by cost served) exported under their own "
                   "label in mtq_tenant_*; the rest are summed as tenant=\"other\".")
@redis_option
def serve(port: int, host: str, queues: tuple[str, ...], tenant_top: int,
          url: str | None) -> None:
    """Serve Prometheus metrics over HTTP (any path) until SIGTERM or Ctrl-C.

    Each scrape reads every exported queue's O(1) counters in one pipelined
    round trip. While Redis is unreachable the exporter keeps answering, with
    mtq_up 0, and recovers by itself. A --queue that Redis does not know exits 3
    (a misspelt name would otherwise export zeros for ever); if Redis is
    unreachable at start the names are not checked. A port in use exits 2."""
    try:
        from mtq.observe.prometheus import (
            MtqCollector,
            exporter_client,
            known_queues,
            make_exporter,
        )
    except ImportError as exc:
        fail(f"the exporter needs prometheus-client ({exc}); pip install 'mtq[metrics]'",
             USAGE)
    import redis

    from mtq.broker.connection import safe_url
    from mtq.validation import check_queue_name

    try:
        for q in queues:
            check_queue_name(q)
        resolved = running_server(url)
        client = exporter_client(resolved)
    except MtqError as exc:
        fail(exc, USAGE)
    if queues:
        try:
            known = set(known_queues(client))
        except (redis.RedisError, redis.exceptions.RedisClusterException) as exc:
            say(f"cannot reach Redis at {safe_url(resolved)} ({exc}); serving mtq_up 0 "
                "until it answers; the queue names are not checked")
        else:
            unknown = [q for q in queues if q not in known]
            if unknown:
                fail(f"no queue named {', '.join(map(repr, unknown))} in Redis at "
                     f"{safe_url(resolved)} (known: {', '.join(sorted(known)) or 'none'}); "
                     "check the name, or submit to the queue first", NOT_FOUND)
    try:
        collector = MtqCollector(client, list(queues) or None, tenant_top=tenant_top)
        server = make_exporter(collector, host, port)
    except OSError as exc:
        fail(f"cannot listen on {host}:{port} ({exc.strerror or exc}); is another exporter "
             "running there? choose another --port", USAGE)

    def stop(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    bound_host, bound_port = server.server_address[:2]
    say(f"serving metrics on http://{bound_host!s}:{bound_port}/metrics "
        f"(Redis {safe_url(resolved)}, queues: {', '.join(queues) or 'all'})")
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        client.close()
    sys.exit(0)
