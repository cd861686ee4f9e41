"""``mtq rq worker``: jobs enqueued by unchanged RQ code (the real rq package), run by
real ``mtq rq worker`` processes against the test's redis-server. Job functions are
in tests/rq_jobs.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest
import redis

rq = pytest.importorskip("rq")

from rq import Callback, Queue, Retry  # noqa: E402
from rq.job import Job, JobStatus  # noqa: E402
from rq.registry import FailedJobRegistry, StartedJobRegistry  # noqa: E402
from rq.serializers import JSONSerializer  # noqa: E402
from rq.worker import Worker  # noqa: E402

from tests import rq_jobs as J  # noqa: E402
from tests.support.paths import ROOT  # noqa: E402
from tests.support.waits import wait_for  # noqa: E402


@pytest.fixture
def env(redis_url: str) -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT), e.get("PYTHONPATH", "")])
    e["MTQ_TEST_REDIS_URL"] = redis_url
    e.pop("RQ_REDIS_URL", None)
    return e


@pytest.fixture
def q(client: redis.Redis, qname: str) -> Queue:
    return Queue(qname, connection=client, serializer=JSONSerializer)


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen]]:
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def start(procs: list, env: dict, url: str, *args: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-m", "mtq", "rq", "worker", *args, "-u", url],
                         env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    procs.append(p)
    return p


def burst(procs: list, env: dict, url: str, *args: str, timeout: float = 40) -> str:
    p = start(procs, env, url, *args, "--burst")
    out, _ = p.communicate(timeout=timeout)
    assert p.returncode == 0, f"mtq rq worker --burst exited {p.returncode}:\n{out}"
    return out


def fetch(client: redis.Redis, job: Job) -> Job:
    return Job.fetch(job.id, connection=client, serializer=job.serializer)


def err(job: Job) -> str:
    """The traceback or message of the job's last result (RQ 2's API; job.exc_info is
    deprecated)."""
    result = job.latest_result()
    assert result is not None, f"job {job.id} has no result"
    return str(result.exc_string)


def test_rq_semantics_in_one_burst(q, client, redis_url, env, procs):
    ok = q.enqueue(J.add, 2, 3)
    bad = q.enqueue(J.boom, "kaput")
    ttl0 = q.enqueue(J.add, 1, 1, result_ttl=0)
    forever = q.enqueue(J.add, 1, 2, result_ttl=-1)
    dep = q.enqueue(J.add, 10, 20, depends_on=ok)
    cb_ok = q.enqueue(J.add, 4, 4, on_success=Callback(J.on_ok))
    cb_bad = q.enqueue(J.boom, on_failure=Callback(J.on_bad))
    key = "flaky-" + uuid.uuid4().hex
    flaky = q.enqueue(J.flaky, key, retry=Retry(max=2))
    retry_key = "retry-" + uuid.uuid4().hex
    retried = q.enqueue(J.retry_once, retry_key)
    timed = q.enqueue(J.sleeper, 5, job_timeout=1)
    unstorable = q.enqueue(J.unstorable)
    missing = q.enqueue("tests.rq_jobs.no_such_function")
    arity = q.enqueue(J.double, 1, 2)
    model = q.enqueue("tests.rq_jobs.Upper", "hi")
    pickled = Queue(q.name, connection=client).enqueue(J.add, 5, 5)  # RQ's default: pickle
    after = q.enqueue(J.add, 100, 1)

    out = burst(procs, env, redis_url, q.name)

    assert fetch(client, ok).get_status() == JobStatus.FINISHED
    assert fetch(client, ok).return_value() == 5
    assert fetch(client, ok).latest_result().type.name == "SUCCESSFUL"
    failed_ids = FailedJobRegistry(q.name, connection=client).get_job_ids()
    b = fetch(client, bad)
    assert b.get_status() == JobStatus.FAILED and bad.id in failed_ids
    assert "ValueError: kaput" in err(b)
    assert "Traceback" in err(b)
    assert not client.exists(ttl0.key), "result_ttl=0 keeps the job"
    assert client.ttl(forever.key) == -1
    assert fetch(client, dep).return_value() == 30
    assert client.lrange(f"cb:{cb_ok.id}", 0, -1) == [b"ok:8"]
    assert client.lrange(f"cb:{cb_bad.id}", 0, -1) == [b"bad:ValueError"]
    f = fetch(client, flaky)
    assert f.get_status() == JobStatus.FINISHED and f.return_value() == "ok"
    assert f.retries_left == 1
    r = fetch(client, retried)
    assert r.get_status() == JobStatus.FINISHED and r.return_value() == "retried"
    assert [x.type.name for x in r.results()] == ["SUCCESSFUL", "RETRIED"]
    t = fetch(client, timed)
    assert t.get_status() == JobStatus.FAILED
    assert "JobTimeoutException" in err(t) and "1 seconds" in err(t)
    u = fetch(client, unstorable)
    assert u.get_status() == JobStatus.FAILED and "cannot be stored" in err(u)
    m = fetch(client, missing)
    assert m.get_status() == JobStatus.FAILED and "cannot import" in err(m)
    a = fetch(client, arity)
    assert a.get_status() == JobStatus.FAILED and "exactly one positional" in err(a)
    assert fetch(client, model).return_value() == "HI"
    p = Job.fetch(pickled.id, connection=client)
    assert p.get_status() == JobStatus.FAILED and pickled.id in failed_ids
    assert "refuses pickled jobs" in err(p) and "--serializer pickle" in err(p)
    assert fetch(client, after).return_value() == 101, "the queue moved on after the refusal"
    assert StartedJobRegistry(q.name, connection=client).count == 0
    assert not client.hlen(f"mtq:rq:{{{q.name}}}:owner"), out


def test_pickle_accepted_with_the_flag(q, client, redis_url, env, procs):
    pickled = Queue(q.name, connection=client).enqueue(J.add, 5, 5)
    burst(procs, env, redis_url, q.name, "--serializer", "pickle")
    assert Job.fetch(pickled.id, connection=client).return_value() == 10


def test_batched_function_groups_jobs_and_a_bad_one_fails_alone(q, client, redis_url, env,
                                                                procs):
    key = "sizes-" + uuid.uuid4().hex
    env["MTQ_TEST_BATCH_KEY"] = key
    jobs = [q.enqueue(J.double, i) for i in range(40)]
    bad = q.enqueue(J.double, "bad")
    more = [q.enqueue(J.double, i) for i in range(40, 48)]
    burst(procs, env, redis_url, q.name)
    sizes = [int(x) for x in client.lrange(key, 0, -1)]
    assert max(sizes) > 1, f"no batch grouped more than one job: {sizes}"
    for i, j in enumerate(jobs + more):
        assert fetch(client, j).return_value() == 2 * i, i
    b = fetch(client, bad)
    assert b.get_status() == JobStatus.FAILED and "bad payload" in err(b)


def test_rq_info_lists_the_worker_and_sigterm_exits_0(q, client, redis_url, env, procs):
    name = "mtqinfo-" + uuid.uuid4().hex[:8]
    p = start(procs, env, redis_url, q.name, "--name", name)
    wait_for(lambda: any(w.name == name for w in Worker.all(connection=client)), 20,
             f"worker {name} did not register with RQ")
    info = subprocess.run(["rq", "info", "-u", redis_url, q.name], capture_output=True,
                          text=True, timeout=30, env=env)
    assert name in info.stdout, info.stdout + info.stderr
    job = q.enqueue(J.add, 1, 2)
    wait_for(lambda: fetch(client, job).get_status() == JobStatus.FINISHED, 20,
             "the running worker did not finish a job")
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=20)
    assert p.returncode == 0, out


def test_unreachable_redis_exits_5(env):
    env["MTQ_REDIS_WAIT_S"] = "0"
    p = subprocess.run([sys.executable, "-m", "mtq", "rq", "worker", "x", "-u",
                        "redis://127.0.0.1:1/0"], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=30)
    assert p.returncode == 5, p.stderr


def _busy_child(client: redis.Redis, qname: str) -> Worker:
    def find() -> Worker | None:
        for w in Worker.all(connection=client):
            if qname in w.queue_names() and w.get_current_job_id():
                return w
        return None

    return wait_for(find, 20, "no mtq rq worker process is running a batch")


@pytest.mark.slow
def test_sigkill_mid_batch_gives_jobs_back_at_the_head_in_order(q, client, redis_url, env,
                                                                procs):
    key = "seen-" + uuid.uuid4().hex
    env["MTQ_TEST_BATCH_SLEEP"] = "1.0"
    tags = [f"t{i:03d}" for i in range(120)]
    jobs = [q.enqueue(J.record_batch, [key, t]) for t in tags]
    start(procs, env, redis_url, q.name, "--lease-ms", "2000")
    victim = _busy_child(client, q.name)
    assert client.llen(key) == 0
    os.kill(victim.pid, signal.SIGKILL)
    wait_for(lambda: client.llen(key) >= len(tags), 40,
             "not every job ran after the kill")
    wait_for(lambda: all(fetch(client, j).get_status() == JobStatus.FINISHED for j in jobs),
             20, "not every job finished after the kill")
    seen = [x.decode() for x in client.lrange(key, 0, -1)]
    assert seen == tags, "a job ran twice, was lost, or did not go back to the head in order"
    for j in jobs:
        assert len(fetch(client, j).results()) == 1


@pytest.mark.slow
def test_frozen_worker_jobs_recovered_and_not_finished_twice(q, client, redis_url, env,
                                                             procs):
    key = "seen-" + uuid.uuid4().hex
    env["MTQ_TEST_BATCH_SLEEP"] = "1.0"
    jobs = [q.enqueue(J.record_batch, [key, f"t{i}"]) for i in range(20)]
    a = start(procs, env, redis_url, q.name, "--lease-ms", "1000", "--name", "frozen")
    victim = _busy_child(client, q.name)
    held = set(StartedJobRegistry(q.name, connection=client).get_job_ids())
    os.kill(victim.pid, signal.SIGSTOP)
    try:
        start(procs, env, redis_url, q.name, "--lease-ms", "1000", "--name", "rescuer")
        wait_for(lambda: all(fetch(client, j).get_status() == JobStatus.FINISHED
                             for j in jobs), 40, "the frozen worker's jobs were not recovered")
    finally:
        os.kill(victim.pid, signal.SIGCONT)
    # the resumed worker ends its call, finds its leases gone and drops its results
    wait_for(lambda: victim.get_current_job_id() is None, 20,
             "the resumed worker did not get past its batch")
    a.send_signal(signal.SIGTERM)
    out, _ = a.communicate(timeout=20)
    assert "given back while this worker held it" in out, out
    for j in jobs:
        results = fetch(client, j).results()
        assert len(results) == 1, f"job {j.id} finished {len(results)} times"
        if j.id in held:
            assert results[0].worker_name.startswith("rescuer"), results[0].worker_name


@pytest.mark.slow
def test_rq_worker_and_mtq_worker_share_a_queue(q, client, redis_url, env, procs):
    key = "seen-" + uuid.uuid4().hex
    tags = [f"t{i}" for i in range(300)]
    jobs = [q.enqueue(J.record, key, t) for t in tags]
    plain = subprocess.Popen(["rq", "worker", "--burst", "-u", redis_url, "--worker-class",
                              "rq.worker.SimpleWorker", "--serializer",
                              "rq.serializers.JSONSerializer", q.name], env=env, cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs.append(plain)
    burst(procs, env, redis_url, q.name)
    assert plain.wait(60) == 0
    seen = sorted(x.decode().split(":")[0] for x in client.lrange(key, 0, -1))
    assert seen == sorted(tags), "a job ran twice or not at all"
    workers = {fetch(client, j).worker_name for j in jobs}
    assert all(fetch(client, j).get_status() == JobStatus.FINISHED for j in jobs)
    assert len(workers) >= 1


def _conns(client: redis.Redis, name: str) -> int:
    return sum(1 for c in client.client_list() if c.get("name") == name)


def test_several_queues_in_order_and_idle_waits_hold_bounded_connections(client, redis_url,
                                                                        env, procs):
    names = ["t-" + uuid.uuid4().hex[:12] for _ in range(3)]
    qs = [Queue(n, connection=client, serializer=JSONSerializer) for n in names]
    key = "seen-" + uuid.uuid4().hex
    # queued before the worker starts: the first-listed queue's jobs run first
    late = [qs[2].enqueue(J.record, key, f"c{i}") for i in range(3)]
    mid = [qs[1].enqueue(J.record, key, f"b{i}") for i in range(3)]
    first = [qs[0].enqueue(J.record, key, f"a{i}") for i in range(3)]
    wname = "multi-" + uuid.uuid4().hex[:8]
    p = start(procs, env, redis_url, *names, "--name", wname)
    wait_for(lambda: client.llen(key) == 9, 30, "the worker did not run the 9 queued jobs")
    seen = [x.decode().split(":")[0] for x in client.lrange(key, 0, -1)]
    assert seen == [f"{c}{i}" for c in "abc" for i in range(3)], seen
    # idle, woken again and again (mostly through the first queue, so that waiters on
    # the others would pile up if each idle wait started new ones): connections bounded
    counts = []
    for round_ in (0, 0, 0, 0, 0, 1, 2):
        wait_for(lambda: any(w.name == wname and w.get_state() == "idle"
                             for w in Worker.all(connection=client)), 20,
                 "the worker did not go idle")
        counts.append(_conns(client, wname))
        job = qs[round_].enqueue(J.add, round_, 1)
        wait_for(lambda j=job: fetch(client, j).get_status() == JobStatus.FINISHED, 20,
                 f"a job on queue {round_} did not wake the idle worker")
    counts.append(_conns(client, wname))
    # one per queue's waiter, the loop's, the heartbeat's (when it overlaps)
    assert max(counts) <= 3 + 2, f"connections grew: {counts}"
    assert all(fetch(client, j).get_status() == JobStatus.FINISHED for j in first + mid + late)
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=20)
    assert p.returncode == 0, out


@pytest.mark.slow
def test_a_job_that_kills_its_worker_fails_after_max_deliveries(q, client, redis_url, env,
                                                                  procs):
    key = "seen-" + uuid.uuid4().hex
    runs = "runs-" + uuid.uuid4().hex
    before = [q.enqueue(J.record, key, f"a{i}") for i in range(3)]
    poison = q.enqueue(J.die, runs)
    after = [q.enqueue(J.record, key, f"b{i}") for i in range(5)]
    p = start(procs, env, redis_url, q.name, "--max-deliveries", "3")
    wait_for(lambda: fetch(client, poison).get_status() == JobStatus.FAILED, 40,
             "the poison job was not failed")
    wait_for(lambda: all(fetch(client, j).get_status() == JobStatus.FINISHED
                         for j in before + after), 30, "the other jobs did not all finish")
    assert int(client.get(runs)) == 3, "the poison job ran other than max-deliveries times"
    assert poison.id in FailedJobRegistry(q.name, connection=client).get_job_ids()
    exc = fetch(client, poison).latest_result().exc_string
    assert "process died 3 times while running it" in exc, exc
    for j in before + after:
        assert len(fetch(client, j).results()) == 1, f"job {j.id} completed twice"
    # the jobs after it ran once: the suspect ran alone after its first kill
    seen = [x.decode().split(":")[0] for x in client.lrange(key, 0, -1)]
    assert sorted(t for t in seen if t.startswith("b")) == [f"b{i}" for i in range(5)], seen
    assert not client.hlen(f"mtq:rq:{{{q.name}}}:deliveries")
    assert StartedJobRegistry(q.name, connection=client).count == 0
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=20)
    assert p.returncode == 0, out
    assert "failed 1 job(s) that was running each of the last 3 times" in out, out


@pytest.mark.slow
def test_a_poison_payload_in_a_batched_call_is_isolated_and_the_rest_complete(
        q, client, redis_url, env, procs):
    jobs = [q.enqueue(J.die_on, f"x{i}") for i in range(3)]
    poison = q.enqueue(J.die_on, "die")
    jobs += [q.enqueue(J.die_on, f"x{i}") for i in range(3, 8)]
    start(procs, env, redis_url, q.name, "--max-deliveries", "3")
    wait_for(lambda: fetch(client, poison).get_status() == JobStatus.FAILED, 50,
             "the poison payload was not isolated and failed")
    wait_for(lambda: all(fetch(client, j).get_status() == JobStatus.FINISHED for j in jobs),
             20, "the innocent payloads of its batch did not all complete")
    for i, j in enumerate(jobs):
        assert fetch(client, j).return_value() == f"ok:x{i}"
    assert "process died" in fetch(client, poison).latest_result().exc_string


@pytest.mark.slow
def test_a_call_stuck_in_c_past_its_timeout_is_killed_and_failed(q, client, redis_url, env,
                                                                   procs):
    runs = "runs-" + uuid.uuid4().hex
    stuck = q.enqueue(J.stuck_in_c, runs, job_timeout=1)
    others = [q.enqueue(J.add, i, 1) for i in range(5)]
    p = start(procs, env, redis_url, q.name, "--hang-grace", "1")
    wait_for(lambda: fetch(client, stuck).get_status() == JobStatus.FAILED, 30,
             "the stuck call was not killed and its job failed")
    wait_for(lambda: all(fetch(client, j).get_status() == JobStatus.FINISHED for j in others),
             30, "the rest of the batch was not given back and run")
    assert int(client.get(runs)) == 1, "the timed-out job was requeued"
    exc = fetch(client, stuck).latest_result().exc_string
    assert "JobTimeoutException" in exc and "(1 seconds)" in exc and "killed" in exc, exc
    assert stuck.id in FailedJobRegistry(q.name, connection=client).get_job_ids()
    for j in others:
        assert len(fetch(client, j).results()) == 1
    assert not client.hlen(f"mtq:rq:{{{q.name}}}:deliveries"), "given-back jobs were counted"
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=20)
    assert p.returncode == 0, out


def test_replicas_two_processes_serve_and_stop_on_sigterm(q, client, redis_url, env, procs):
    base = "rep-" + uuid.uuid4().hex[:8]
    p = start(procs, env, redis_url, q.name, "--replicas", "2", "--devices", "cpu",
              "--name", base)

    def ours() -> list[str]:
        return sorted(w.name for w in Worker.all(connection=client) if w.name.startswith(base))

    wait_for(lambda: len(ours()) == 2, 30, "two worker processes did not register with RQ")
    info = subprocess.run(["rq", "info", "-u", redis_url, q.name], capture_output=True,
                          text=True, timeout=30, env=env)
    assert all(n in info.stdout for n in ours()), info.stdout + info.stderr
    key = "rdv-" + uuid.uuid4().hex
    a = q.enqueue(J.rendezvous, key, 2)
    wait_for(lambda: client.get(key) == b"1", 20, "the first job did not start")
    b = q.enqueue(J.rendezvous, key, 2)  # only the other process is free to take it
    wait_for(lambda: all(fetch(client, j).get_status() == JobStatus.FINISHED for j in (a, b)),
             20, "the two jobs did not run at once in two processes")
    assert {fetch(client, j).worker_name for j in (a, b)} == set(ours())
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=20)
    assert p.returncode == 0, out
    wait_for(lambda: not ours(), 10, "the stopped processes are still registered")


def test_dependencies_with_allow_failure_and_repeat(q, client, redis_url, env, procs):
    from rq import Repeat
    from rq.job import Dependency

    ok = q.enqueue(J.add, 1, 1)
    bad = q.enqueue(J.boom, "no")
    dep = q.enqueue(J.add, 2, 2, depends_on=Dependency(jobs=[ok, bad], allow_failure=True))
    strict = q.enqueue(J.add, 3, 3, depends_on=Dependency(jobs=[ok, bad]))
    key = "rep-" + uuid.uuid4().hex
    rep = q.enqueue(J.record, key, "r", repeat=Repeat(times=2))
    burst(procs, env, redis_url, q.name)
    assert fetch(client, dep).return_value() == 4, "allow_failure: runs after a failure"
    assert fetch(client, strict).get_status() == JobStatus.DEFERRED
    assert client.llen(key) == 3, "Repeat(times=2): the first run and two repeats"
    assert len(fetch(client, rep).results()) == 3


@pytest.mark.slow
def test_scheduler_re_enqueues_retries_with_an_interval(q, client, redis_url, env, procs):
    key = "flaky-" + uuid.uuid4().hex
    job = q.enqueue(J.flaky, key, retry=Retry(max=2, interval=1))
    p = start(procs, env, redis_url, q.name, "--with-scheduler")
    wait_for(lambda: fetch(client, job).get_status() == JobStatus.FINISHED, 30,
             "the retry was not re-enqueued by RQ's scheduler and run")
    assert fetch(client, job).return_value() == "ok"
    assert int(client.get(key)) == 2
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=20)
    assert p.returncode == 0, out


def test_django_rq_app_enqueues_and_mtq_rq_worker_runs_it(qname, redis_url, env, procs):
    import importlib.util

    if importlib.util.find_spec("django_rq") is None:  # importing it needs Django settings
        pytest.skip("django-rq is not installed")
    manage = str(ROOT / "tests" / "django_project" / "manage.py")
    env = {**env, "MTQ_DJANGO_RQ_URL": redis_url, "MTQ_DJANGO_RQ_QUEUE": qname}
    env.pop("DJANGO_SETTINGS_MODULE", None)

    def shell(code: str) -> str:
        out = subprocess.run([sys.executable, manage, "shell", "-c", code], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip().splitlines()[-1]

    job_id = shell("import django_rq; from tests.django_project.rq_tasks import word_count; "
                   f"print(django_rq.get_queue({qname!r}).enqueue(word_count, 'a b c').id)")
    burst(procs, {**env, "DJANGO_SETTINGS_MODULE": "tests.django_project.settings"},
          redis_url, qname)
    got = shell(f"import django_rq, json; j = django_rq.get_queue({qname!r}).fetch_job("
                f"{job_id!r}); print(json.dumps([j.get_status(), j.return_value()]))")
    assert json.loads(got) == ["finished", {"words": 3, "django_rq": True}], got


def test_retries_with_an_interval_run_out_under_the_cli_scheduler(
        q: Queue, client: redis.Redis, redis_url: str, env: dict, procs: list) -> None:
    # the retries go through the worker's scheduler, as under rq worker --with-scheduler
    key = "attempts-" + uuid.uuid4().hex
    job = q.enqueue(J.fail_counting, key, retry=Retry(max=2, interval=1))
    start(procs, env, redis_url, q.name, "--with-scheduler")
    wait_for(lambda: fetch(client, job).get_status() == JobStatus.FAILED, 40,
             f"the job never failed for good: {fetch(client, job).get_status()}, "
             f"{client.get(key)} attempts")
    assert client.get(key) == b"3"  # the first run and two retries, as under rq worker
    assert fetch(client, job).retries_left == 0


def test_a_burst_under_rq_suspend_exits_at_once_and_leaves_the_jobs(
        q, client, redis_url, env, procs):
    from rq.suspension import resume, suspend

    job = q.enqueue(J.add, 2, 3)
    suspend(client)
    try:
        out = burst(procs, env, redis_url, q.name, timeout=30)  # exit 0, asserted there
    finally:
        resume(client)
    assert "suspended in burst mode" in out and "died" not in out, out
    assert q.count == 1 and fetch(client, job).get_status() == JobStatus.QUEUED


def test_a_fresh_worker_claims_one_job_so_an_idle_one_takes_the_rest(
        q, client, redis_url, env, procs):
    # a worker that has timed no job yet cannot tell that the first is slow: it claims
    # that one alone, and the jobs behind it go to the next worker
    flag, key = "flag-" + uuid.uuid4().hex, "fast-" + uuid.uuid4().hex
    slow = q.enqueue(J.until_flag, flag)
    fast = [q.enqueue(J.record, key, f"f{i}") for i in range(3)]
    first = start(procs, env, redis_url, q.name, "--burst", "-n", "first")
    wait_for(lambda: fetch(client, slow).get_status() == JobStatus.STARTED, 30,
             "the first worker never started the slow job")
    second = start(procs, env, redis_url, q.name, "--burst", "-n", "second")
    try:
        wait_for(lambda: client.llen(key) == 3, 30,
                 f"the fast jobs did not run beside the slow one: {q.count} queued")
        assert {fetch(client, j).worker_name.split(".")[0] for j in fast} == {"second"}
    finally:
        client.set(flag, 1)
    for p in (first, second):
        out, _ = p.communicate(timeout=40)
        assert p.returncode == 0, out
    assert fetch(client, slow).return_value() == "done"


def test_rq_worker_options_max_idle_time_dequeue_strategy_and_d(
        q, client, redis_url, env, procs):
    other = Queue(q.name + "-b", connection=client, serializer=JSONSerializer)
    key = "order-" + uuid.uuid4().hex
    for _ in range(2):
        q.enqueue(J.record, key, "a")
        other.enqueue(J.record, key, "b")
    bad = q.enqueue(J.boom, "kaput")
    p = start(procs, env, redis_url, q.name, other.name, "--max-idle-time", "1",
              "--dequeue-strategy", "round_robin", "-d")
    out, _ = p.communicate(timeout=40)  # not --burst: it exits once idle for 1 s
    assert p.returncode == 0, out
    assert [x.decode().split(":")[0] for x in client.lrange(key, 0, -1)] == ["a", "b", "a", "b"]
    assert fetch(client, bad).get_status() == JobStatus.FAILED
    assert bad.id not in FailedJobRegistry(q.name, connection=client).get_job_ids()


# -- model options (--set CLASS.KEY=VALUE) ---------------------------------------------
@pytest.mark.parametrize("sets,says", [
    (["tests.rq_jobs.Tagged.prefix"], "--set takes CLASS.KEY=VALUE, CLASS the model's "
                                      "dotted path as enqueued"),
    (["prefix=>"], "--set takes CLASS.KEY=VALUE"),
    (["tests.rq_jobs.Tagged.prefix=>", "tests.rq_jobs.Tagged.prefix=<"],
     "--set tests.rq_jobs.Tagged.prefix is given twice"),
    (["tests.rq_jobs.Tagged.prefix=>", "tests.rq_jobs.Tagged.prefx=<"],
     "'tests.rq_jobs.Tagged' has no option 'prefx' (did you mean 'prefix'?)"),
    (["tests.rq_jobs.Tagged.prefix=>", "tests.rq_jobs.Tagged.repeat=4"],
     "option 'repeat' must be >= 1 and <= 3, got 4"),
    (["tests.rq_jobs.Tagged.upper=yes"],
     "option 'prefix' is required: give it with --set tests.rq_jobs.Tagged.prefix=VALUE"),
    (["tests.rq_jobs.add.x=1"], "'tests.rq_jobs.add' is not an mtq.Model class"),
    (["tests.rq_jobs.NoSuchModel.x=1"], "cannot import 'tests.rq_jobs.NoSuchModel'"),
], ids=["no-value", "no-class", "twice", "unknown", "range", "required", "function",
        "missing"])
def test_a_bad_model_option_exits_2_before_redis_is_reached(env, sets, says):
    env["MTQ_REDIS_WAIT_S"] = "60"  # exit 2 at once: Redis was not waited for
    args = [a for s in sets for a in ("--set", s)]
    p = subprocess.run([sys.executable, "-m", "mtq", "rq", "worker", "x", *args, "-u",
                        "redis://127.0.0.1:1/0"], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=30)
    err = " ".join(p.stderr.split())
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert says in err, err
    assert "cannot reach" not in err and "Traceback" not in err, err


def test_model_options_reach_the_model_s_setup(q, client, redis_url, env, procs):
    by_name = q.enqueue("tests.rq_jobs.Tagged", "hi")
    other = q.enqueue("tests.rq_jobs.Tagged", "yo")
    plain = q.enqueue("tests.rq_jobs.Upper", "up")
    burst(procs, env, redis_url, q.name, "--set", "tests.rq_jobs.Tagged.prefix=>> ",
          "--set", "tests.rq_jobs.Tagged.upper=yes", "--set", "tests.rq_jobs.Tagged.repeat=2")
    assert fetch(client, by_name).return_value() == ">> HIHI"
    assert fetch(client, other).return_value() == ">> YOYO"
    assert fetch(client, plain).return_value() == "UP"
    # without its required option the model's jobs fail, saying what to give
    missing = q.enqueue("tests.rq_jobs.Tagged", "hi")
    burst(procs, env, redis_url, q.name)
    job = fetch(client, missing)
    assert job.get_status() == JobStatus.FAILED
    assert "option 'prefix' is required: give it with --set " \
        "tests.rq_jobs.Tagged.prefix=VALUE" in err(job)
