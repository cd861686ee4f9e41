"""``mtq worker run`` (one worker in this process) and ``mtq workers ...`` (supervised
worker processes: start, list, and the commands sent to running supervisors)."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from contextlib import ExitStack
from typing import Any

import click

from mtq.broker.connection import REACH_TIMEOUT_S
from mtq.cli import common
from mtq.cli.common import (
    FAILED,
    USAGE,
    FloatRange,
    fail,
    fail_on,
    redis_option,
    running_server,
    say,
    shown,
)
from mtq.cli.engines import COMMANDS as ENGINE_COMMANDS
from mtq.errors import MtqError

_queue_opt = click.option("--queue", "-q", required=True, help="Queue to serve.")
_app_dir_opt = click.option(
    "--app-dir", default=".", show_default=True, type=click.Path(file_okay=False),
    help="Where the target's code is: put first on the import path of this process "
         "and of the processes it starts.")
_wait_opt = click.option(
    "--wait-for-redis", is_flag=True,
    help="At start, wait for an unreachable Redis without a limit (default: give up "
         f"after MTQ_REDIS_WAIT_S, {REACH_TIMEOUT_S:.0f} s unless set, and exit 5).")


class _HiddenAliases(click.Option):
    """An option whose later names are aliases kept working but left out of --help."""

    def get_help_record(self, ctx: click.Context) -> tuple[str, str] | None:
        shown_opts, self.opts = self.opts, self.opts[:1]
        try:
            return super().get_help_record(ctx)
        finally:
            self.opts = shown_opts

    def get_error_hint(self, ctx: click.Context | None) -> str:
        return repr(self.opts[0])


#: the batch size, one name for every command (the model's attribute, the host file's
#: key); ``--batch-size`` is kept as a hidden alias
_max_batch_opt = click.option(
    "--max-batch-size", "--batch-size", "max_batch_size", cls=_HiddenAliases, default=None,
    type=click.IntRange(1, 100_000),
    help="Most tasks per batch: overrides the model's max_batch_size.")


_set_opt = click.option(
    "--set", "sets", multiple=True, metavar="KEY=VALUE",
    help="A model option the target declares (mtq.Option), e.g. --set model=/srv/minilm; "
         "repeat it for each. Checked before any process starts (exit 2).")


def _model_options(target: str, sets: tuple[str, ...]) -> dict[str, str]:
    """The --set pairs as a dict, checked against the options the target declares
    (importing its module) when there are some, or the target is one mtq ships.
    Exits 2 on a malformed, unknown or missing one."""
    from mtq.workers.options import parse_pairs
    from mtq.workers.target import ALIASES, check_options

    try:
        options = parse_pairs(sets)
        if options or target.partition(":")[0] in ALIASES:
            check_options(target, options)
    except MtqError as exc:
        fail(exc, USAGE)
    return options


def _overrides(**given: Any) -> dict[str, Any] | None:
    """The queue settings given on the command line, over the queue's stored ones."""
    return {k: v for k, v in given.items() if v is not None} or None


def _import_from(app_dir: str) -> None:
    from mtq.workers.target import add_app_dir

    try:
        add_app_dir(app_dir)
    except MtqError as exc:
        fail(exc, USAGE)


def _reach(url: str | None, wait: bool) -> str:
    """Wait for Redis before anything starts (see mtq.broker.connection.reach): a wrong
    address, password or certificate is one line and exit 5. Returns the URL."""
    from mtq.broker.connection import connect, reach, resolve_url, safe_url
    from mtq.errors import RedisUnavailable

    limit: float | None = None
    try:
        if not wait:
            limit = float(os.environ.get("MTQ_REDIS_WAIT_S") or REACH_TIMEOUT_S)
            if not 0 <= limit < float("inf"):
                raise ValueError(limit)
    except ValueError:
        fail("MTQ_REDIS_WAIT_S must be a number of seconds (0 or more)", USAGE)
    try:
        resolved = resolve_url(url)
        deadline = None if limit is None else time.monotonic() + limit
        while True:  # a cluster's client reads the slot map when it is made: wait for it
            try:
                client = connect(resolved)
                break
            except RedisUnavailable as exc:
                if deadline is not None and time.monotonic() >= deadline:
                    raise
                say(f"cannot reach {safe_url(resolved)} ({exc.__cause__ or exc}); "
                    "retrying in 1 s")
                time.sleep(1.0)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        reach(client, resolved, say, timeout_s=left)
    except MtqError as exc:
        fail_on(exc)
    return resolved


@click.group()
def worker() -> None:
    """Run one worker in this process (no supervisor; see 'mtq workers start')."""


@worker.command("run")
@click.argument("target")
@_queue_opt
@redis_option
@_max_batch_opt
@click.option("--max-wait-ms", default=None, type=FloatRange(0, 60_000),
              help="Longest wait for a batch to fill (default: the model's max_wait_ms).")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda:N or mps.")
@click.option("--lease-ms", default=None, type=click.IntRange(1),
              help="Lease of a claimed task, extended every second (default: the queue's "
                   "lease_ms, see 'mtq queue config').")
@click.option("--burst", is_flag=True, help="Exit when the queue has nothing left to do.")
@_set_opt
@_app_dir_opt
@_wait_opt
def worker_run(target: str, queue: str, url: str | None, max_batch_size: int | None,
               max_wait_ms: float | None, device: str, lease_ms: int | None, burst: bool,
               sets: tuple[str, ...], app_dir: str, wait_for_redis: bool) -> None:
    """Serve QUEUE with TARGET ('package.module:attr': an mtq.Model subclass or a
    plain function). SIGTERM/SIGINT stop it after the running batch; a second
    signal exits at once (its tasks return when their leases expire)."""
    from mtq.workers.control import Listener
    from mtq.workers.signals import on_stop_signals
    from mtq.workers.target import load_model
    from mtq.workers.worker import Worker

    _import_from(app_dir)
    options = _model_options(target, sets)
    try:  # a target that cannot be loaded is bad input, whatever Redis does
        load_model(target, options=options)
    except MtqError as exc:
        fail(exc, USAGE)
    url = _reach(url, wait_for_redis)
    try:
        w = Worker(target, queue, url=url, settings=_overrides(lease_ms=lease_ms),
                   device=device, max_batch_size=max_batch_size, max_wait_ms=max_wait_ms,
                   options=options)
    except MtqError as exc:
        fail(exc, USAGE)  # the target cannot be loaded, or an option is out of range
    try:
        w.setup()
    except Exception as exc:  # the model's own setup(): the work failed
        logging.getLogger("mtq.cli").info("setup failed", exc_info=True)
        fail(f"setup of {target} failed: {type(exc).__name__}: {exc} (-v shows the "
             "traceback)", FAILED)
    on_stop_signals(w.stop)  # the first stops the worker, a second exits (130)
    listener = Listener(w.consumer.redis, w.queue, w.command)
    listener.start()
    if burst:
        w.command({"cmd": "drain"})
    w.freeze_startup()
    try:
        totals = w.run()
    except MtqError as exc:
        fail_on(exc)
    finally:
        listener.close()
    common.err_console.print(f"worker stopped: {totals}")


@click.group()
def workers() -> None:
    """Start, list and control supervised worker processes."""


#: the flags a host file replaces (its key, where it goes); with --config, exit 2
_FILE_FLAGS = {"queue": ("--queue", "queue, in each [[engine]]"),
               "devices_spec": ("--devices", "devices, in [host]"),
               "replicas": ("--replicas", "replicas, in [host]"),
               "max_batch_size": ("--max-batch-size", "max_batch_size, in each [[engine]]"),
               "max_wait_ms": ("--max-wait-ms", "max_wait_ms, in each [[engine]]"),
               "timeout_s": ("--timeout", "timeout, in each [[engine]]"),
               "lease_ms": ("--lease-ms", "lease_ms, in [host]"),
               "standby": ("--standby", "standby, in [host]"),
               "sets": ("--set", "options = { KEY = VALUE }, in each [[engine]]")}


@workers.command("start")
@click.argument("target", required=False)
@click.option("--queue", "-q", default=None, help="Queue to serve (with TARGET).")
@click.option("--config", "config", default=None, metavar="HOST.TOML",
              type=click.Path(dir_okay=False),
              help="A host file: several queues, each with its target and options, served "
                   "by the same processes (one engine per queue), with their devices, "
                   "replicas and memory budget; in place of TARGET, --queue and the flags "
                   "it holds (see docs/workers.md, The host file). Checked before anything "
                   "starts: a mistake exits 2, naming its line.")
@redis_option
@click.option("--devices", "devices_spec", default="cpu", show_default=True,
              help="cpu | cuda:0,cuda:1 | all (every GPU, or cpu without one).")
@click.option("--replicas", default=1, show_default=True, type=click.IntRange(0, 256),
              help="Worker processes per device.")
@_max_batch_opt
@click.option("--max-wait-ms", default=None, type=FloatRange(0, 60_000),
              help="Override the model's max_wait_ms.")
@click.option("--timeout", "timeout_s", default=None, type=FloatRange(min=0.001),
              help="Override the model's timeout_s: longest one predict call may run.")
@click.option("--lease-ms", default=None, type=click.IntRange(100),
              help="Lease of a claimed task, extended every second (default: the queue's "
                   "lease_ms, see 'mtq queue config').")
@click.option("--standby", default=None, type=click.IntRange(0, 1),
              help="A warm spare process per device that takes over at once when a worker "
                   "process dies (default: 1 on the CPU, 0 on a GPU, where it holds a "
                   "second copy of the model in device memory).")
@click.option("--autoscale", default=None, metavar="MIN:MAX",
              help="Scale the process count from the queue's backlog and measured service "
                   "time, between MIN and MAX (0:N scales to zero); ',drain=S' (default 10) "
                   "and ',cooldown=S' (default 30) after it (see docs/autoscaling.md).")
@_set_opt
@_app_dir_opt
@_wait_opt
@click.option("--no-scheduler", "no_scheduler", is_flag=True,
              help="Run no scheduler thread (by default one runs the schedules, 'mtq "
                   "schedule', as one of their possible leaders).")
@click.pass_context
def workers_start(ctx: click.Context, target: str | None, queue: str | None,
                  config: str | None, url: str | None, devices_spec: str, replicas: int,
                  max_batch_size: int | None, max_wait_ms: float | None,
                  timeout_s: float | None, lease_ms: int | None, standby: int | None,
                  sets: tuple[str, ...], app_dir: str, wait_for_redis: bool,
                  no_scheduler: bool, autoscale: str | None = None) -> None:
    """Serve QUEUE with TARGET ('package.module:attr') in REPLICAS processes per
    device, restarted when they die; or, with --config HOST.TOML, every queue of a
    host file from the same processes. SIGTERM/SIGINT drain gracefully; a second
    signal forces."""
    from mtq.workers.autoscale import Autoscaler, parse_range
    from mtq.workers.devices import parse_devices
    from mtq.workers.supervisor import Supervisor
    from mtq.workers.target import find_target_module

    if config is not None:
        if target is not None:
            fail(f"give TARGET with --queue, or --config {config}, not both", USAGE)
        for name, (flag, where) in _FILE_FLAGS.items():
            if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT:
                fail(f"{flag} does not go with --config: the host file holds it ({where})",
                     USAGE)
        if autoscale:
            fail("--autoscale serves one queue: give TARGET and --queue, not --config", USAGE)
        _start_host(config, url, app_dir, wait_for_redis, not no_scheduler)
        return
    if target is None:
        fail("give TARGET with --queue, or --config HOST.TOML (see 'mtq workers start "
             "--help')", USAGE)
    if queue is None:
        fail("missing option --queue / -q: the queue TARGET serves", USAGE)
    _import_from(app_dir)
    try:  # (the module is imported in the worker processes, not here)
        find_target_module(target)
    except MtqError as exc:
        fail(exc, USAGE)
    options = _model_options(target, sets)
    url = _reach(url, wait_for_redis)
    try:
        policy = parse_range(autoscale) if autoscale else None
        if policy is not None:  # it starts at MIN processes (per device: see docs/autoscaling.md)
            replicas = math.ceil(policy.low / len(parse_devices(devices_spec)))
        sup = Supervisor(target, queue, url=url, devices_spec=devices_spec, replicas=replicas,
                         settings=_overrides(lease_ms=lease_ms),
                         max_batch_size=max_batch_size, max_wait_ms=max_wait_ms,
                         timeout_s=timeout_s, standby=standby, options=options,
                         on_event=say)
        if policy is not None:
            sup.autoscaler = Autoscaler(sup, policy)
    except MtqError as exc:
        fail(exc, 2)
    given = "".join(f" --set {k}={v}" for k, v in options.items())
    say(f"supervisor {sup.id} serving {queue!r} with {target}{given} on "
        f"{', '.join(sup.devices)} x {replicas}")
    from mtq.workers.scheduler import alongside

    with alongside(url, not no_scheduler):
        code = sup.run()
    sys.exit(code)


def _start_host(path: str, url: str | None, app_dir: str, wait_for_redis: bool,
                scheduler: bool = True) -> None:
    """``mtq workers start --config HOST.TOML``: read and check the whole file (exit 2
    on the first mistake, nothing started), then supervise its processes."""
    from mtq.workers.hostfile import load
    from mtq.workers.supervisor import Supervisor

    _import_from(app_dir)
    try:
        spec = load(path)
    except MtqError as exc:
        fail(exc, USAGE)
    url = _reach(url, wait_for_redis)
    try:
        sup = Supervisor(url=url, devices_spec=spec.devices, replicas=spec.replicas,
                         settings=_overrides(lease_ms=spec.lease_ms), standby=spec.standby,
                         engines=[e.to_dict() for e in spec.engines],
                         memory_budget=spec.memory_budget, max_loaded=spec.max_loaded,
                         on_event=say)
    except MtqError as exc:
        fail(exc, USAGE)
    served = ", ".join(f"{e.queue!r} with {e.target}" for e in spec.engines)
    say(f"supervisor {sup.id} serving {served} (host file {path}) on "
        f"{', '.join(sup.devices)} x {spec.replicas}")
    from mtq.workers.scheduler import alongside

    with ExitStack() as stack:
        try:  # the host file's schedules written (Redis may have gone since it answered)
            stack.enter_context(alongside(url, scheduler, spec.schedules))
        except MtqError as exc:
            fail_on(exc)
        code = sup.run()
    sys.exit(code)


@workers.command("list")
@click.option("--queue", "-q", default=None, help="Only workers of this queue.")
@redis_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def workers_list(queue: str | None, url: str | None, as_json: bool) -> None:
    """Live workers from the registry, one row per engine (one queue's model in one
    process): its process (host:pid), device, model, state, whether its model is
    loaded (engine), the model's memory, its last use, batch sizes, rate."""
    from mtq.broker.connection import connect
    from mtq.broker.registry import list_workers

    url = running_server(url)
    try:
        rows = list_workers(connect(url), queue)
    except MtqError as exc:
        fail_on(exc)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    from rich.table import Table

    table = Table(title=f"{len(rows)} worker(s)")
    # the id is host:pid:suffix: it names the process too (engines of one process
    # share host:pid)
    for col in ("id", "queue", "device", "model", "state", "engine", "memory", "last use",
                "batch", "typical", "tasks/s", "done", "beat age"):
        table.add_column(col)
    for w in rows:
        cells = [w["id"], w.get("queue"), w.get("device"), f"{w.get('model')}/{w.get('version')}",
                 w.get("state"), w.get("engine") or "-", common.held_memory(w),
                 common.ago(w.get("last_used")), w.get("batch"), w.get("typical_batch"),
                 w.get("tasks_per_s"), w.get("succeeded"), f"{w['heartbeat_age_s']:.1f}s"]
        # all of it from Redis: shown as text, never as markup or terminal control
        table.add_row(*(shown(c) for c in cells))
    common.console.print(table)


def _control(cmd: str, queue: str, url: str | None, worker_id: str | None = None,
             replicas: int | None = None) -> None:
    from mtq.broker.connection import connect
    from mtq.workers import control

    url = running_server(url)
    try:
        n = control.send(connect(url), queue, cmd, worker=worker_id, replicas=replicas)
    except MtqError as exc:
        fail_on(exc)
    if n == 0:
        common.err_console.print(f"[yellow]no supervisor of queue {queue!r} is listening[/]")
        sys.exit(4)
    common.console.print(f"{cmd}: sent to {n} supervisor(s) of {queue!r}")


def _control_command(cmd: str, help_text: str) -> None:
    @workers.command(cmd, help=help_text)
    @_queue_opt
    @redis_option
    @click.option("--worker", "worker_id", default=None, help="Only this worker id.")
    def _cmd(queue: str, url: str | None, worker_id: str | None) -> None:
        _control(cmd, queue, url, worker_id)


_control_command("pause", "Stop claiming; claimed-ahead tasks go back to the queue.")
_control_command("resume", "Claim again after a pause.")
_control_command("drain", "Work until the queue is empty, then exit.")
_control_command("stop", "Finish running batches, give the rest back, exit.")


for _engine_command in ENGINE_COMMANDS:  # load, unload, reload, reset (mtq.cli.engines)
    workers.add_command(_engine_command)


@workers.command("scale")
@click.argument("replicas", type=click.IntRange(0, 256))
@_queue_opt
@redis_option
def workers_scale(replicas: int, queue: str, url: str | None) -> None:
    """Set the number of worker processes per device of the running supervisors."""
    _control("scale", queue, url, replicas=replicas)
