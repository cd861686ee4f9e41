"""``mtq dashboard --web``: the web dashboard (:mod:`mtq.dashboard.web`) under uvicorn."""

from __future__ import annotations

from mtq.cli.common import USAGE, fail, fail_on, say
from mtq.errors import MtqError

#: what the dashboard shows a reader who is not signed in, when it listens beyond loopback
BEYOND_LOOPBACK = (
    "listening on {host}, beyond loopback: anyone who can reach it reads the queues, "
    "tenants, workers, task ids and error messages; payloads, results, tokens and "
    "tracebacks are shown to signed-in admins only, and every action needs an admin "
    "key. Serve it behind a proxy with TLS (see docs/dashboard.md)")


def run_web(url: str, host: str, port: int, refresh_s: float, *, origin: str | None = None,
            log_level: str = "warning") -> int:
    """Serve the web dashboard of the Redis at ``url`` on ``host``:``port`` until
    SIGINT or SIGTERM; the exit code (0). Live streams end at once on shutdown.
    ``origin``: its public origin behind a proxy (a malformed one exits 2)."""
    try:
        import uvicorn  # noqa: F401  (run_until_stopped's server)

        from mtq.dashboard.web.app import create_dashboard
    except ImportError as exc:
        fail(f"mtq dashboard --web needs the web extra ({exc}): pip install 'mtq[web]'", USAGE)
    from mtq.broker.connection import connect, safe_url
    from mtq.cli.serve import is_loopback, run_until_stopped

    private = is_loopback(host)
    try:
        client = connect(url, name="mtq-dashboard")
        app = create_dashboard(client=client, refresh_s=refresh_s, show_previews=private,
                               origin=origin)
    except MtqError as exc:
        fail_on(exc)
    if not private:
        say(BEYOND_LOOPBACK.format(host=host))
    shown = f"[{host}]" if ":" in host else host
    say(f"web dashboard of {safe_url(url)} at http://{shown}:{port}/ (Ctrl-C stops it)")
    started = run_until_stopped(app, app.state.dashboard.sampler.stop_soon, host=host,
                                port=port, log_level=log_level)
    return 0 if started else 1
