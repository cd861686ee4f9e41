"""Schedules (mtq.client.schedules, mtq.workers.scheduler, ``mtq schedule``): bad input
writes nothing, catch-up policies, a fenced leader, exactly once across a SIGKILLed
leader (real ``mtq schedule run`` processes)."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest
from click.testing import CliRunner

import mtq
from mtq.broker.keys import QueueKeys
from mtq.cli.main import cli
from mtq.client import schedules as sch
from mtq.errors import InvalidName, PayloadError, ScheduleError
from mtq.workers.scheduler import Scheduler
from tests.support.paths import PY
from tests.support.processes import kill_process
from tests.support.waits import wait_for

KEYS = (sch.DEFS, sch.CURSOR, sch.LEASE, sch.VERSION)


@pytest.fixture(autouse=True)
def clean(r) -> Iterator[None]:
    """Schedules are global to a Redis: each test starts and ends with none."""
    r.delete(*KEYS)
    yield
    r.delete(*KEYS)


def ids(r, queue: str) -> list[str]:
    prefix = QueueKeys(queue).task_prefix
    return sorted(k.decode()[len(prefix):] for k in r.keys(prefix + "s-*"))


def seconds(r, queue: str, name: str) -> list[int]:
    return sorted(int(i.rsplit("-", 1)[1]) for i in ids(r, queue)
                  if i.startswith(f"s-{name}-"))


def test_add_list_remove_and_bad_input_writes_nothing(client, qname):
    s = sch.add(client, "nightly", qname, "30 2 * * *", {"k": 1}, stream="s1",
                tenant="acme", tz="Europe/Paris", catch_up="all")
    assert [x.as_dict() for x in sch.list_schedules(client, qname)] == [s.as_dict()]
    assert sch.list_schedules(client, "other") == []
    version = client.get(sch.VERSION)
    bad = [
        (ScheduleError, dict(name="nightly")),  # taken
        (ScheduleError, dict(cron="61 * * * *")),
        (ScheduleError, dict(cron="* * * * * * *")),
        (ScheduleError, dict(tz="Mars/Olympus")),
        (ScheduleError, dict(catch_up="some")),
        (ScheduleError, dict(name="bad name")),
        (InvalidName, dict(queue="bad queue")),
        (PayloadError, dict(payload={1, 2})),
    ]
    for err, change in bad:
        args = dict(name="n2", queue=qname, cron="* * * * *", payload=1) | change
        with pytest.raises(err):
            sch.add(client, args.pop("name"), args.pop("queue"), args.pop("cron"),
                    args.pop("payload"), **args)
    assert client.get(sch.VERSION) == version
    assert [x.name for x in sch.list_schedules(client)] == ["nightly"]
    assert sch.remove(client, "nightly") and not sch.remove(client, "nightly")
    assert sch.list_schedules(client) == [] and client.hlen(sch.CURSOR) == 0


def test_cli_add_list_remove_and_exit_codes(redis_url, qname, r):
    run = CliRunner().invoke
    base = ["--redis", redis_url]
    res = run(cli, ["schedule", "add", qname, "*/5 * * * *", '{"p": 1}', "--name", "five",
                    "--tz", "UTC", "--catch-up", "none", *base])
    assert res.exit_code == 0, res.output
    for argv in (["schedule", "add", qname, "nope", "1"],
                 ["schedule", "add", qname, "* * * * *", "{bad json"],
                 ["schedule", "add", qname, "* * * * *", "1", "--tz", "Nowhere/X"],
                 ["schedule", "add", qname, "* * * * *", "1", "--name", "five"],
                 ["schedule", "add", "bad queue", "* * * * *", "1"]):
        res = run(cli, [*argv, *base])
        assert res.exit_code == 2, (argv, res.output)
    res = run(cli, ["schedule", "list", qname, "--json", *base])
    rows = json.loads(res.output)
    assert [(x["name"], x["catch_up"], x["payload"]) for x in rows] == [("five", "none",
                                                                          {"p": 1})]
    assert run(cli, ["schedule", "remove", "five", *base]).exit_code == 0
    assert run(cli, ["schedule", "remove", "five", *base]).exit_code == 3


@pytest.mark.parametrize(("policy", "expect"), [("all", 10), ("latest", 1), ("none", 0)])
def test_catch_up_policy_after_a_gap(client, qname, r, policy, expect):
    sch.add(client, "gap", qname, "* * * * * *", "x", catch_up=policy)
    now = float(int(time.time()))
    r.hset(sch.CURSOR, "gap", int(now) - 10)  # no scheduler ran for 10 s
    s = Scheduler(client=client, lease_ms=2000, grace_s=0.5)
    assert s._lead()
    s.tick(now + 0.9)  # every one of (now-10, now] is missed (older than grace_s)
    got = seconds(r, qname, "gap")
    assert len(got) == expect
    if policy == "latest":
        assert got == [int(now)]
    # on time again: the cursor moved past the gap, whatever the policy
    assert float(r.hget(sch.CURSOR, "gap")) >= now
    s.tick(now + 1.2)  # now + 1 is on time
    assert seconds(r, qname, "gap")[-1:] == [int(now) + 1]


def test_a_stale_leader_submits_nothing_twice_and_advances_nothing(client, qname, r):
    sch.add(client, "tick", qname, "* * * * * *", "x", catch_up="all")
    now = float(int(time.time()))
    r.hset(sch.CURSOR, "tick", int(now) - 3)
    a = Scheduler(client=client, lease_ms=5000, grace_s=60)
    assert a._lead()
    a.tick(now)
    assert seconds(r, qname, "tick") == [int(now) - 2, int(now) - 1, int(now)]
    # a's lease lapses (it froze); b leads and rewinds nothing
    r.delete(sch.LEASE)
    b = Scheduler(client=client, lease_ms=5000, grace_s=60)
    assert b._lead()
    r.hset(sch.CURSOR, "tick", int(now) - 3)  # as if a had been killed before advancing
    a.tick(now)  # a still thinks it leads: its submits are duplicates, its advance refused
    assert not a.leader
    assert float(r.hget(sch.CURSOR, "tick")) == now - 3
    b.tick(now)  # b re-submits the same occurrences: refused as duplicates, no double
    assert seconds(r, qname, "tick") == [int(now) - 2, int(now) - 1, int(now)]
    assert float(r.hget(sch.CURSOR, "tick")) == now
    assert a.submitted == 3 and b.submitted == 0


def test_the_leader_wakes_for_a_new_schedule_and_stops_for_a_removed_one(
        redis_url, client, qname, r):
    s = Scheduler(redis_url, lease_ms=3000)
    t = threading.Thread(target=s.run, daemon=True)
    t.start()
    try:
        wait_for(lambda: s.leader, 5, "the only scheduler never took the lease")
        sch.add(client, "sec", qname, "* * * * * *", "x", catch_up="none")
        wait_for(lambda: len(seconds(r, qname, "sec")) >= 2, 5,
                 "a per-second schedule added while the leader slept did not run")
        sch.remove(client, "sec")
        after = len(seconds(r, qname, "sec"))
        time.sleep(1.5)  # the absence of submits is what is checked: no event to wait on
        assert len(seconds(r, qname, "sec")) <= after + 1
    finally:
        s.stop()
        t.join(5)
    assert not t.is_alive() and r.get(sch.LEASE) is None  # released on the way out


def scheduler_process(env: dict[str, str], log) -> subprocess.Popen[bytes]:
    return subprocess.Popen([PY, "-m", "mtq", "schedule", "run", "--lease-ms", "600"],
                            env=env, stdout=log, stderr=subprocess.STDOUT)


def test_two_scheduler_processes_leader_sigkilled_no_occurrence_lost_or_doubled(
        client, qname, r, subprocess_env, tmp_path):
    mtq.Queue(qname, client=client).schedule("beat", "* * * * * *", {"n": 1},
                                             catch_up="all")
    logs = [open(tmp_path / f"s{i}.log", "wb") for i in range(2)]
    procs = [scheduler_process(subprocess_env, log) for log in logs]
    try:
        wait_for(lambda: len(seconds(r, qname, "beat")) >= 2, 10,
                 "no scheduler process submitted the per-second schedule")
        token = r.get(sch.LEASE).decode()
        leader = next(i for i in range(2)
                      if token in (tmp_path / f"s{i}.log").read_text())
        procs[leader].send_signal(signal.SIGKILL)
        procs[leader].wait(5)
        killed_at = time.time()
        wait_for(lambda: r.get(sch.LEASE) not in (None, token.encode()), 5,
                 "the other scheduler did not take the lease over")
        wait_for(lambda: seconds(r, qname, "beat")[-1] >= killed_at + 2, 6,
                 "the new leader did not go on submitting")
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(5)
            finally:
                kill_process(p)
        for log in logs:
            log.close()
    got = seconds(r, qname, "beat")
    assert got == list(range(got[0], got[-1] + 1)), f"an occurrence was lost: {got}"
    assert r.get(sch.LEASE) is None  # the survivor released it on SIGTERM
    assert procs[1 - leader].returncode == 0


def test_time_zones_and_daylight_saving_days():
    from datetime import datetime, timezone

    def utc(expr: str, zone: str, day: str) -> list[str]:
        start = datetime.fromisoformat(day + "T00:00:00+00:00").timestamp() - 6 * 3600
        return [datetime.fromtimestamp(t, timezone.utc).strftime("%m-%d %H:%M")
                for t in sch.occurrences(expr, zone, start, start + 24 * 3600)]

    assert utc("30 2 * * *", "UTC", "2026-03-29") == ["03-29 02:30"]
    # clocks go forward at 02:00 in Paris: 02:30 does not exist, it runs once at 03:00
    assert utc("30 2 * * *", "Europe/Paris", "2026-03-29") == ["03-29 01:00"]
    # clocks go back at 03:00: 02:30 happens twice (CEST, then CET), it runs twice
    assert utc("30 2 * * *", "Europe/Paris", "2026-10-25") == ["10-25 00:30", "10-25 01:30"]


def host_text(qname: str, schedule: str) -> str:
    return (f'[host]\nstandby = 0\n\n[[engine]]\nqueue = "{qname}"\n'
            f'target = "tests.models:Probe"\n\n[[schedule]]\n{schedule}')


def test_a_host_files_schedules_are_checked_with_their_line(qname):
    from mtq.errors import HostFileError
    from mtq.workers.hostfile import parse

    spec = parse(host_text(qname, f'name = "h1"\nqueue = "{qname}"\ncron = "* * * * *"\n'
                                  'payload = { a = 1 }\ntz = "Europe/Paris"\n'))
    assert spec.schedules == ({"name": "h1", "queue": qname, "cron": "* * * * *",
                               "payload": {"a": 1}, "tz": "Europe/Paris", "stream": None,
                               "tenant": None, "catch_up": "latest"},)
    for body, says in ((f'name = "h1"\nqueue = "{qname}"\ncron = "nope"\npayload = 1\n',
                        "host.toml:8: bad cron expression 'nope'"),
                       (f'name = "h1"\nqueue = "{qname}"\ncron = "* * * * *"\n',
                        "host.toml:8: [[schedule]] 1 has no payload"),
                       (f'name = "h1"\nqueue = "{qname}"\ncron = "* * * * *"\npayload = 1\n'
                        'zone = "UTC"\n', "host.toml:13: unknown key 'zone'")):
        with pytest.raises(HostFileError) as err:
            parse(host_text(qname, body))
        assert says in str(err.value)


def test_put_replaces_a_schedule_keeping_its_cursor_unless_retimed(client, qname, r):
    a = sch.put(client, "p", qname, "* * * * *", 1)
    version = r.get(sch.VERSION)
    assert sch.put(client, "p", qname, "* * * * *", 1) == a
    assert r.get(sch.VERSION) == version  # the same: nothing written
    r.hset(sch.CURSOR, "p", 5)
    b = sch.put(client, "p", qname, "* * * * *", 2, stream="s")  # same times
    assert (b.payload, b.stream, b.created) == (2, "s", a.created)
    assert r.hget(sch.CURSOR, "p") == b"5" and r.get(sch.VERSION) != version
    # a new cron starts from now: no occurrence of it before now counts as missed
    before = int(time.time())
    c = sch.put(client, "p", qname, "*/2 * * * *", 2, stream="s")
    assert (c.cron, c.created) == ("*/2 * * * *", a.created)
    assert int(r.hget(sch.CURSOR, "p")) >= before
    r.hset(sch.CURSOR, "p", 5)
    sch.put(client, "p", qname, "*/2 * * * *", 2, stream="s", tz="Europe/Paris")
    assert int(r.hget(sch.CURSOR, "p")) >= before  # so does a new zone


def test_workers_start_runs_its_host_files_schedule(client, qname, r, subprocess_env,
                                                    tmp_path):
    from tests.support.supervisors import Sup

    path = tmp_path / "host.toml"
    path.write_text(host_text(qname, f'name = "hb"\nqueue = "{qname}"\n'
                                     'cron = "* * * * * *"\npayload = { n = 1 }\n'
                                     'catch_up = "none"\n'))
    log = tmp_path / "sup.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([PY, "-m", "mtq", "workers", "start", "--config", str(path)],
                                env=subprocess_env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    sup = Sup(proc, log)
    try:
        q = mtq.Queue(qname, client=client)
        wait_for(lambda: q.stats()["succeeded"] >= 2, 20,
                 f"the host's scheduler thread ran no occurrence: {log.read_text()}")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        sup.kill()
    assert r.get(sch.LEASE) is None  # its thread released the lease on the way out


def test_the_scheduler_rides_through_its_connections_killed(redis_url, client, qname, r):
    import redis as redis_py

    own = redis_py.Redis.from_url(redis_url, client_name="mtqsched-kill")
    sch.add(client, "ride", qname, "* * * * * *", "x", catch_up="all")
    s = Scheduler(client=own, lease_ms=600)
    t = threading.Thread(target=s.run, daemon=True)
    t.start()
    try:
        wait_for(lambda: len(seconds(r, qname, "ride")) >= 1, 5, "no first occurrence")
        for kind in ("pubsub", "normal"):
            for c in r.client_list(_type=kind):
                if c.get("name") == "mtqsched-kill" or kind == "pubsub":
                    r.client_kill_filter(_id=c["id"])
        killed = time.time()
        wait_for(lambda: seconds(r, qname, "ride")[-1] >= killed + 1, 6,
                 "the scheduler stopped submitting after its connections were killed")
        assert t.is_alive()
    finally:
        s.stop()
        t.join(5)
        own.close()
    got = seconds(r, qname, "ride")
    assert got == list(range(got[0], got[-1] + 1)), got


@pytest.mark.parametrize(("policy", "expect"), [("all", sch.CATCH_UP_MAX), ("latest", 1)])
def test_catch_up_after_a_gap_longer_than_the_bound_is_bounded_and_ends_at_now(
        client, qname, r, policy, expect):
    """A gap of 3000 occurrences: one tick submits at most CATCH_UP_MAX (all) or the
    very latest one (latest), and the cursor reaches now: the next tick submits none
    of the gap."""
    sch.add(client, "long", qname, "* * * * * *", "x", catch_up=policy)
    now = float(int(time.time()))
    r.hset(sch.CURSOR, "long", int(now) - 3000)
    s = Scheduler(client=client, lease_ms=5000, grace_s=0.5)
    assert s._lead()
    s.tick(now + 0.9)
    got = seconds(r, qname, "long")
    assert len(got) == expect
    assert got[-1] == int(now), "the latest missed occurrence is now's"
    assert float(r.hget(sch.CURSOR, "long")) == now
    s.tick(now + 0.9)
    assert len(seconds(r, qname, "long")) == expect


def test_a_schedule_removed_mid_catch_up_stops_firing(client, qname, r):
    """Removed while the leader catches up (after it read the cursors): the cursor's
    advance finds it gone, and the rest of its occurrences are not submitted."""
    sch.add(client, "gone", qname, "* * * * * *", "x", catch_up="all")
    now = float(int(time.time()))
    s = Scheduler(client=client, lease_ms=5000, grace_s=60)
    assert s._lead()
    sched = sch.get(client, "gone")
    assert sched is not None
    assert sch.remove(client, "gone")
    s._run_one(sched, now - 20, now)  # what the tick read before the removal
    assert len(seconds(r, qname, "gone")) <= 1
    assert r.hget(sch.CURSOR, "gone") is None and s.leader


def test_workers_starts_scheduler_leaves_at_once_with_redis_hung(tmp_path):
    """``mtq workers start``'s scheduler thread (alongside) must not lengthen its stop
    when Redis answers nothing (frozen): the supervisor's forced stop is bounded (2 s in
    all: test_stops.py) and the thread only gives its lease back on a best effort."""
    from mtq.workers.scheduler import alongside
    from tests.support.servers import RedisServer

    server = RedisServer(tmp_path)
    server.start()
    try:
        with alongside(server.url) as sched:
            assert sched is not None
            wait_for(lambda: sched.leader, 10, "the scheduler thread leads")
            assert server.proc is not None
            server.proc.send_signal(signal.SIGSTOP)
            t0 = time.monotonic()
        took = time.monotonic() - t0
        assert took < 1.0, f"the scheduler thread held the stop {took:.2f} s"
    finally:
        if server.proc is not None:
            server.proc.send_signal(signal.SIGCONT)
        server.stop()


def test_workers_start_says_redis_refused_its_host_files_schedules(qname, r, redis_url,
                                                                    subprocess_env, tmp_path):
    """Redis answers, then refuses the schedules' write (a user without EVAL): the
    named error and exit 5, not a traceback; no process is left serving."""
    path = tmp_path / "host.toml"
    path.write_text(host_text(qname, f'name = "hb"\nqueue = "{qname}"\n'
                                     'cron = "* * * * *"\npayload = 1\n'))
    user = f"noeval-{qname}"
    r.acl_setuser(user, enabled=True, passwords=["+pw"], keys=["*"], channels=["*"],
                  commands=["+@all", "-eval", "-evalsha"])
    try:
        url = redis_url.replace("redis://", f"redis://{user}:pw@")
        out = subprocess.run([PY, "-m", "mtq", "workers", "start", "--config", str(path),
                              "--redis", url], env=subprocess_env, capture_output=True,
                             text=True, timeout=60)
    finally:
        r.acl_deluser(user)
    assert out.returncode == 5, out.stderr
    assert "Traceback" not in out.stderr and "may not do this" in out.stderr, out.stderr
    assert r.hlen(sch.DEFS) == 0
