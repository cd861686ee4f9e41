"""``mtq serve``: the OpenAI-compatible gateway (:mod:`mtq.gateway`) under uvicorn."""

from __future__ import annotations

import gc
import importlib
import ipaddress
import signal
import socket
from collections.abc import Callable
from typing import Any

import click

from mtq.cli.common import USAGE, fail, fail_on, redis_option, running_server
from mtq.errors import GatewayUnprotected, MtqError


def is_loopback(host: str) -> bool:
    """True when every address ``host`` names is a loopback one (127.0.0.0/8, ::1)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(str(i[4][0]).split("%")[0]).is_loopback
                               for i in infos)


def parse_models(pairs: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        name, sep, queue = pair.partition("=")
        if not sep or not name or not queue:
            fail(f"--model takes NAME=QUEUE (the model name clients send, and the queue "
                 f"that serves it), got {pair!r}", USAGE)
        out[name] = queue
    return out


def check_protected(client: object, host: str, require: bool = False) -> bool:
    """Whether requests need a key: beyond loopback, or ``require`` (a reverse proxy
    on the same host: every client then comes from loopback), where at least one key
    must exist (else GatewayUnprotected)."""
    if is_loopback(host) and not require:
        return False
    try:  # mtq.client.apikeys: the API keys (imported here, not at start-up)
        keys: Any = importlib.import_module("mtq.client.apikeys")
    except ImportError:
        keys = None
    if keys is None or not keys.any_keys(client):
        where = "with --require-keys" if is_loopback(host) else "beyond loopback"
        raise GatewayUnprotected(
            f"refusing to serve on {host}, {where}, without API keys: anyone "
            "reaching it could use the models. Create one first ('mtq keys create "
            "--tenant T'), or serve on --host 127.0.0.1")
    return True


def run_until_stopped(app: Any, on_stop: Callable[[], None], *, host: str, port: int,
                      log_level: str) -> bool:
    """Run ``app`` under uvicorn until SIGINT or SIGTERM; whether it started. A stop
    first calls ``on_stop`` (the dashboard's ``sampler.stop_soon``: its live streams
    end at once, else uvicorn would wait for them until its graceful timeout)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            on_stop()
            super().handle_exit(sig, frame)

    server = Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                   timeout_graceful_shutdown=5))
    # uvicorn restores the handlers it found and raises the signal that stopped it
    # again: found these, a stop asked by SIGINT or SIGTERM is a clean exit
    previous = {sig: signal.signal(sig, lambda *_: None)
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return bool(server.started)


@click.command("serve")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on. Beyond loopback, API keys are required and at "
                   "least one must exist ('mtq keys create').")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535),
              help="Port to listen on.")
@click.option("--model", "models", multiple=True, metavar="NAME=QUEUE",
              help="Serve the model name NAME from QUEUE (repeatable). A name not "
                   "mapped is the queue of that name.")
@click.option("--timeout", default=600.0, show_default=True, type=click.FloatRange(min=1),
              help="Longest a request waits for its task (then 504, the task cancelled).")
@click.option("--max-body", default=1 << 20, show_default=True, type=click.IntRange(min=1024),
              help="Largest request body in bytes (larger: 413).")
@click.option("--require-keys", is_flag=True,
              help="Require an API key on every request on loopback too: behind a reverse "
                   "proxy on the same host, whose clients all come from loopback.")
@click.option("--origin", default=None, metavar="URL",
              help="The dashboard's public origin (https://host[:port]) behind a proxy "
                   "that changes the Host header (else its actions are refused as "
                   "cross-site).")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]),
              help="uvicorn's log level.")
@redis_option
def serve(host: str, port: int, models: tuple[str, ...], timeout: float, max_body: int,
          require_keys: bool, origin: str | None, log_level: str, url: str | None) -> None:
    """Serve the OpenAI API (/v1/chat/completions, /v1/completions, /v1/embeddings,
    /v1/models) over mtq queues, with uvicorn, and the web dashboard at /dashboard.
    See docs/gateway.md and docs/dashboard.md."""
    try:
        import uvicorn  # noqa: F401  (run_until_stopped's server)

        from mtq.gateway import create_app
    except ImportError as exc:
        fail(f"mtq serve needs the web extra ({exc}): pip install 'mtq[web]'", USAGE)
    mapping = parse_models(models)
    url = running_server(url)
    try:
        from mtq.broker.connection import connect

        client = connect(url, name="mtq-gateway")
        require = check_protected(client, host, require_keys)
        app = create_app(client=client, models=mapping, require_keys=require,
                         timeout_s=timeout, max_body_bytes=max_body)
        # the web dashboard at /dashboard (payloads for signed-in admins only where
        # keys are required)
        from mtq.dashboard.web.app import create_dashboard

        dashboard = create_dashboard(client=client, show_previews=not require,
                                     origin=origin)
        app.mount("/dashboard", dashboard)
    except MtqError as exc:
        fail_on(exc)
    # what start-up made lives as long as the process: out of the collector's sight, a
    # full collection no longer walks it while 500 streams wait (tens of ms otherwise)
    gc.freeze()
    if not run_until_stopped(app, dashboard.state.dashboard.sampler.stop_soon, host=host,
                             port=port, log_level=log_level):
        raise SystemExit(1)
