"""docker-compose.yml, the Dockerfile and .dockerignore, checked without Docker.

Nothing here needs a Docker engine: the files are parsed, and every ``mtq ...``
command a service runs is resolved through the real click groups and parsed with
click, so a renamed command, an unknown option or a bad value fails here rather
than in a container that restarts forever.
"""

from __future__ import annotations

import fnmatch
import itertools
import posixpath
import re
import shlex
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

yaml = pytest.importorskip("yaml")

from mtq.validation import check_queue_name  # noqa: E402
from mtq.workers.devices import parse_devices  # noqa: E402
from mtq.workers.target import load_model  # noqa: E402
from tests.support.cli_parse import parse_mtq  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"

SERVICES = ("redis", "gpu-worker", "cpu-worker", "dashboard")
MTQ_SERVICES = ("gpu-worker", "cpu-worker", "dashboard", "exporter")
WORKERS = ("gpu-worker", "cpu-worker")
#: mtq commands that serve a TARGET (package.module:attr)
SERVING = (("mtq", "workers", "start"), ("mtq", "worker", "run"))
#: top-level packages of targets that only an extra makes usable in the image
EXTRA_FOR_PACKAGE = {"examples": "examples"}


# -- loading -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    assert COMPOSE.is_file(), f"{COMPOSE} is missing: add the Compose file at the repo root"
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict), "docker-compose.yml must be a mapping with 'services'"
    return data


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    found = compose.get("services") or {}
    assert isinstance(found, dict), "docker-compose.yml: 'services' must be a mapping"
    return found


@pytest.fixture(scope="module")
def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


class Instruction:
    """One Dockerfile instruction, with the WORKDIR and ENV in force when it runs."""

    def __init__(self, op: str, arg: str, workdir: str, env: dict[str, str]) -> None:
        self.op, self.arg, self.workdir, self.env = op, arg, workdir, dict(env)

    def __repr__(self) -> str:
        return f"{self.op} {self.arg}"


def read_dockerfile(text: str) -> list[Instruction]:
    """Instructions in order (comments dropped, continuation lines joined)."""
    logical: list[str] = []
    buf = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        logical.append(buf + line)
        buf = ""
    if buf.strip():
        logical.append(buf)
    out: list[Instruction] = []
    workdir, env = "/", {}
    for line in logical:
        op, _, arg = line.partition(" ")
        op, arg = op.upper(), arg.strip()
        if op == "WORKDIR":
            workdir = posixpath.normpath(posixpath.join(workdir, arg))
        elif op == "ENV":
            parts = shlex.split(arg)
            if parts and "=" not in parts[0]:  # legacy form: ENV KEY value
                env[parts[0]] = " ".join(parts[1:])
            else:
                env.update(p.split("=", 1) for p in parts)
        out.append(Instruction(op, arg, workdir, env))
    return out


@pytest.fixture(scope="module")
def dockerfile() -> list[Instruction]:
    assert DOCKERFILE.is_file(), f"{DOCKERFILE} is missing: docker-compose.yml builds it"
    return read_dockerfile(DOCKERFILE.read_text())


def command_of(services: dict[str, dict[str, Any]], name: str) -> list[str]:
    cmd = services[name].get("command")
    assert isinstance(cmd, list) and cmd and all(isinstance(a, str) for a in cmd), (
        f"service {name}: write 'command' in list form of strings, e.g. "
        f"[\"mtq\", \"workers\", \"start\", ...], got {cmd!r}")
    return cmd


def environment_of(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        return dict(str(e).split("=", 1) if "=" in str(e) else (str(e), "") for e in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def redis_argv(service: dict[str, Any]) -> list[str]:
    raw = service.get("command") or []
    return shlex.split(raw) if isinstance(raw, str) else [str(a) for a in raw]


def seconds(duration: object) -> float:
    """A Compose duration ('60s', '1m30s', '90') in seconds."""
    text = str(duration).strip()
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = re.findall(r"(\d+(?:\.\d+)?)(us|ms|s|m|h)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"bad duration {duration!r}"
    scale = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    return sum(float(n) * scale[u] for n, u in parts)


def test_the_command_check_rejects_what_mtq_would_reject() -> None:
    """The resolver itself: bad command lines fail it, so the checks below are not vacuous."""
    good = parse_mtq(["mtq", "workers", "start", "a.b:C", "-q", "x", "--replicas", "3"], "ok")
    assert good.path == ("mtq", "workers", "start")
    assert good.params["replicas"] == 3 and good.params["target"] == "a.b:C"
    assert good.given("replicas") and not good.given("devices_spec")
    for bad in (["mtq", "workers", "begin", "a.b:C", "-q", "x"],         # no such command
                ["mtq", "workers", "start", "a.b:C", "-q", "x", "--device", "cpu"],
                ["mtq", "workers", "start", "a.b:C", "-q", "x", "--replicas", "two"],
                ["mtq", "workers", "start", "a.b:C", "-q"],              # -q without a value
                ["mtq", "workers"],                                      # no subcommand
                ["mtq", "-v"],
                ["mtq", "dashboard", "--refresh", "0"],                  # out of range
                ["mtq", "dashboard", "--help"]):
        with pytest.raises(pytest.fail.Exception):
            parse_mtq(bad, "bad")


# -- docker-compose.yml ------------------------------------------------------------------
def test_compose_has_the_four_services_and_no_version_key(compose: dict[str, Any],
                                                          services: dict[str, Any]) -> None:
    assert "version" not in compose, (
        "docker-compose.yml: drop the top-level 'version' key (obsolete in the Compose spec)")
    missing = [s for s in SERVICES if s not in services]
    assert not missing, f"docker-compose.yml: add the service(s) {missing}"


def test_redis_persists_to_a_volume_and_has_a_healthcheck(compose: dict[str, Any],
                                                          services: dict[str, Any]) -> None:
    redis = services["redis"]
    image = str(redis.get("image", ""))
    assert image.startswith("redis:"), f"redis: use the official image (redis:7.2), got {image!r}"
    version = image.partition(":")[2]
    major_minor = tuple(int(p) for p in re.findall(r"\d+", version)[:2])
    assert major_minor >= (6, 2), f"redis: mtq needs Redis 6.2 or newer, got {image!r}"
    argv = redis_argv(redis)
    pairs = dict(itertools.pairwise(argv))
    assert pairs.get("--appendonly") == "yes", (
        f"redis: add '--appendonly yes' to its command so queued tasks survive a restart; "
        f"command is {argv!r}")
    assert pairs.get("--appendfsync") in ("everysec", "always"), (
        f"redis: add '--appendfsync everysec' to its command; command is {argv!r}")
    volumes = [str(v) if not isinstance(v, dict) else f"{v.get('source')}:{v.get('target')}"
               for v in redis.get("volumes") or []]
    data = [v for v in volumes if v.split(":")[1:2] == ["/data"]]
    assert data, f"redis: mount a named volume at /data (the append-only file), got {volumes!r}"
    source = data[0].split(":")[0]
    assert source in (compose.get("volumes") or {}), (
        f"redis: declare the volume {source!r} under the top-level 'volumes' key")
    test = redis.get("healthcheck", {}).get("test")
    test_text = " ".join(test) if isinstance(test, list) else str(test)
    assert "redis-cli" in test_text and "ping" in test_text, (
        f"redis: add a healthcheck running 'redis-cli ping', got {test!r}")
    for port in redis.get("ports") or []:
        text = str(port) if not isinstance(port, dict) else str(port.get("host_ip", ""))
        assert text.startswith("127.0.0.1"), (
            f"redis: publish its port on 127.0.0.1 only (it has no password), got {port!r}")


@pytest.mark.parametrize("name", MTQ_SERVICES)
def test_mtq_services_are_built_from_the_dockerfile(services: dict[str, Any],
                                                    name: str) -> None:
    build = services[name].get("build")
    context = build if isinstance(build, str) else (build or {}).get("context")
    dockerfile = "Dockerfile" if isinstance(build, str) else (build or {}).get(
        "dockerfile", "Dockerfile")
    assert context is not None, f"{name}: add 'build: .' so it runs the repo's Dockerfile"
    assert (ROOT / context / dockerfile).resolve() == DOCKERFILE, (
        f"{name}: build context {context!r} / {dockerfile!r} is not the repo's Dockerfile")


@pytest.mark.parametrize("name", MTQ_SERVICES)
def test_service_commands_are_real_mtq_commands(services: dict[str, Any], name: str) -> None:
    parsed = parse_mtq(command_of(services, name), name)
    queues = list(parsed.params.get("queues") or ())
    if parsed.params.get("queue") is not None:
        queues.append(parsed.params["queue"])
    for queue in queues:
        try:
            check_queue_name(queue)
        except Exception as exc:
            pytest.fail(f"{name}: bad --queue: {exc}")
    spec = parsed.params.get("devices_spec")
    if spec not in (None, "all"):  # 'all' asks torch how many GPUs there are
        try:
            parse_devices(spec)
        except Exception as exc:
            pytest.fail(f"{name}: bad --devices: {exc}")


@pytest.mark.parametrize("name", WORKERS)
def test_worker_targets_load(services: dict[str, Any], name: str) -> None:
    parsed = parse_mtq(command_of(services, name), name)
    assert parsed.path in SERVING, (
        f"{name}: run 'mtq workers start TARGET --queue Q ...', got {' '.join(parsed.path)}")
    # (click lets TARGET and --queue be left out, for --config; mtq then exits 2)
    assert parsed.params.get("target") and parsed.params.get("queue"), (
        f"{name}: run 'mtq workers start TARGET --queue Q ...', got {command_of(services, name)}")
    target = parsed.params["target"]
    try:  # imports the module and builds the model; weights load in setup(), not here
        load_model(target)
    except Exception as exc:
        pytest.fail(f"{name}: its target {target!r} does not load: {exc}")


def test_workers_use_the_compose_redis(services: dict[str, Any]) -> None:
    # the port inside the compose network, not the published one
    port = int(dict(itertools.pairwise(redis_argv(services["redis"]))).get("--port", 6379))
    for name in MTQ_SERVICES:
        parsed = parse_mtq(command_of(services, name), name)
        env = environment_of(services[name])
        url = parsed.params.get("url") if parsed.given("url") else env.get("MTQ_REDIS_URL")
        assert url, (f"{name}: set MTQ_REDIS_URL=redis://redis:6379/0 in its environment; "
                     "without it mtq starts a private embedded server in the container")
        parts = urlparse(url)
        assert parts.hostname == "redis" and (parts.port or 6379) == port, (
            f"{name}: MTQ_REDIS_URL {url!r} does not point at the redis service "
            f"(use redis://redis:{port}/0)")
        depends = services[name].get("depends_on") or {}
        condition = (depends.get("redis") or {}).get("condition") if isinstance(
            depends, dict) else None
        assert condition == "service_healthy", (
            f"{name}: add 'depends_on: {{redis: {{condition: service_healthy}}}}' so it "
            "starts once Redis answers")


def _gpu_devices(service: dict[str, Any]) -> list[dict[str, Any]]:
    deploy = service.get("deploy") or {}
    devices = (((deploy.get("resources") or {}).get("reservations") or {})
               .get("devices") or [])
    return [d for d in devices if isinstance(d, dict)]


def test_gpu_worker_reserves_nvidia_gpus_and_the_cpu_worker_none(
        services: dict[str, Any]) -> None:
    gpu = services["gpu-worker"]
    devices = _gpu_devices(gpu)
    assert devices, ("gpu-worker: add deploy.resources.reservations.devices "
                     "[{driver: nvidia, count: all, capabilities: [gpu]}]")
    dev = devices[0]
    assert dev.get("driver") == "nvidia", f"gpu-worker: the device driver must be nvidia: {dev}"
    assert "gpu" in (dev.get("capabilities") or []), (
        f"gpu-worker: the device needs capabilities [gpu]: {dev}")
    count = dev.get("count", dev.get("device_ids"))
    assert count == "all" or isinstance(count, (int, list)), (
        f"gpu-worker: give the device 'count: all' (or a number, or device_ids): {dev}")
    spec = parse_mtq(command_of(services, "gpu-worker"), "gpu-worker").params["devices_spec"]
    assert spec == "all" or spec.startswith("cuda"), (
        f"gpu-worker: serve the GPUs it reserves with --devices all (or cuda:N), got {spec!r}")
    assert not _gpu_devices(services["cpu-worker"]), "cpu-worker: it must not reserve GPUs"
    spec = parse_mtq(command_of(services, "cpu-worker"), "cpu-worker").params["devices_spec"]
    assert spec == "cpu", f"cpu-worker: run it with --devices cpu, got {spec!r}"


@pytest.mark.parametrize("name", WORKERS)
def test_workers_drain_on_stop_and_restart(services: dict[str, Any], name: str) -> None:
    service = services[name]
    assert service.get("stop_signal", "SIGTERM") == "SIGTERM", (
        f"{name}: stop_signal must be SIGTERM, the signal on which mtq workers drain")
    grace = seconds(service.get("stop_grace_period", "10s"))
    assert grace >= 30, (f"{name}: set stop_grace_period to 60s or so (it is {grace:g} s), "
                         "long enough for running batches and generations to finish")
    assert service.get("restart") in ("unless-stopped", "always", "on-failure"), (
        f"{name}: add 'restart: unless-stopped' so a crashed supervisor comes back")


def test_dashboard_is_interactive(services: dict[str, Any]) -> None:
    dash = services["dashboard"]
    assert parse_mtq(command_of(services, "dashboard"), "dashboard").path == (
        "mtq", "dashboard"), "dashboard: run 'mtq dashboard'"
    assert dash.get("tty") is True and dash.get("stdin_open") is True, (
        "dashboard: set 'tty: true' and 'stdin_open: true' (it draws a live screen and "
        "reads q to quit)")


def test_mtq_home_volume_is_writable_by_the_image_user(services: dict[str, Any],
                                                       dockerfile: list[Instruction]) -> None:
    text = DOCKERFILE.read_text()
    for name in WORKERS:
        home = environment_of(services[name]).get("MTQ_HOME")
        if not home:
            continue
        mounted = [str(v).split(":")[1] for v in services[name].get("volumes") or []
                   if not isinstance(v, dict) and ":" in str(v)]
        if home in mounted:
            assert re.search(rf"ch(own|mod)\b[^\n]*{re.escape(home)}", text), (
                f"{name}: the Dockerfile must create {home} and give it to the non-root "
                "user, else a fresh named volume there is owned by root and unwritable")


# -- Dockerfile and .dockerignore ----------------------------------------------------------
def _pip_installs(dockerfile: list[Instruction]) -> list[list[str]]:
    """The arguments of every 'pip install' in a RUN, options and their values dropped."""
    takes_value = {"-r", "--requirement", "-c", "--constraint", "-i", "--index-url",
                   "--extra-index-url", "-f", "--find-links", "-t", "--target", "--prefix",
                   "--root", "--platform", "--python-version", "--only-binary",
                   "--no-binary", "--progress-bar", "--cache-dir"}
    found = []
    for ins in dockerfile:
        if ins.op != "RUN":
            continue
        words = shlex.split(ins.arg)
        commands: list[list[str]] = [[]]
        for w in words:
            if w in ("&&", "||", ";", "|"):
                commands.append([])
            else:
                commands[-1].append(w.rstrip(";"))
        for c in commands:
            for i in range(len(c) - 1):
                if c[i] in ("pip", "pip3") or c[i].endswith("/pip") or (
                        c[i] == "-m" and i and c[i + 1] == "pip"):
                    j = i + 1 if c[i] != "-m" else i + 2
                    if j < len(c) and c[j] == "install":
                        args, skip = [], False
                        for a in c[j + 1:]:
                            if skip:
                                skip = False
                            elif a in takes_value:
                                skip = True
                            elif not a.startswith("-"):
                                args.append(a)
                        found.append(args)
                    break
    return found


def _extras(req: str) -> set[str]:
    m = re.fullmatch(r"\.\[([^\]]*)\]", req)
    return {e.strip() for e in m.group(1).split(",")} if m else set()


def test_dockerfile_base_user_and_environment(dockerfile: list[Instruction],
                                              pyproject: dict[str, Any]) -> None:
    froms = [i for i in dockerfile if i.op == "FROM"]
    assert froms and froms[-1].arg.split()[0] == "python:3.11-slim", (
        f"Dockerfile: build FROM python:3.11-slim, got {froms!r}")
    required = pyproject["project"]["requires-python"]
    minimum = tuple(int(p) for p in re.findall(r"\d+", required)[:2])
    assert (3, 11) >= minimum, f"Dockerfile: python 3.11 does not satisfy {required!r}"
    users = [i.arg.split(":")[0] for i in dockerfile if i.op == "USER"]
    assert users and users[-1] not in ("root", "0"), (
        "Dockerfile: end with 'USER <a non-root user>' (useradd one first)")
    env = dockerfile[-1].env
    assert env.get("PYTHONUNBUFFERED") == "1", (
        "Dockerfile: set ENV PYTHONUNBUFFERED=1 so worker logs reach 'docker compose logs' "
        "at once")
    assert not [i for i in dockerfile if i.op == "ENTRYPOINT"], (
        "Dockerfile: the compose commands start with 'mtq'; drop the ENTRYPOINT (or drop the "
        "leading 'mtq' from every command and change this test)")


def test_dockerfile_installs_the_extras_the_commands_need(
        services: dict[str, Any], dockerfile: list[Instruction],
        pyproject: dict[str, Any]) -> None:
    extras_defined: dict[str, list[str]] = pyproject["project"]["optional-dependencies"]
    installs = _pip_installs(dockerfile)
    assert installs, "Dockerfile: install the package with pip install '.[workers,examples]'"
    installed: set[str] = set()
    for args in installs:
        for req in args:
            assert req == "." or _extras(req), (
                f"Dockerfile: install {req!r} through the package's extras in pyproject.toml "
                "(pip install '.[...]'), so pyproject's version constraints hold "
                "(plain 'torch' pulls whatever PyPI has)")
            installed |= _extras(req)
    unknown = installed - set(extras_defined)
    assert not unknown, f"Dockerfile: pyproject.toml defines no extra(s) {sorted(unknown)}"
    # an extra may name others: "mtq[workers]"
    todo = list(installed)
    while todo:
        for dep in extras_defined.get(todo.pop(), []):
            m = re.fullmatch(r"mtq\[([^\]]*)\]", dep.replace(" ", ""))
            for extra in m.group(1).split(",") if m else []:
                if extra not in installed:
                    installed.add(extra)
                    todo.append(extra)
    needed: dict[str, str] = {}
    for name in WORKERS:
        target = parse_mtq(command_of(services, name), name).params["target"]
        needed.setdefault("workers", name)  # torch: models and GPUs
        package = target.split(":")[0].split(".")[0]
        if package in EXTRA_FOR_PACKAGE:
            needed.setdefault(EXTRA_FOR_PACKAGE[package], name)
    for name in MTQ_SERVICES:
        if parse_mtq(command_of(services, name), name).path == ("mtq", "metrics", "serve"):
            needed.setdefault("metrics", name)  # prometheus-client
    for extra, name in needed.items():
        assert extra in installed, (
            f"Dockerfile: {name} needs the {extra!r} extra; install '.[{','.join(needed)}]'")


def _copies(dockerfile: list[Instruction]) -> list[tuple[list[str], str]]:
    """(sources, destination as an absolute path) of every COPY/ADD from the context."""
    out = []
    for ins in dockerfile:
        if ins.op not in ("COPY", "ADD"):
            continue
        words = [w for w in shlex.split(ins.arg) if not w.startswith("--")]
        if any(w.startswith("--from") for w in shlex.split(ins.arg)):
            continue
        *sources, dest = words
        out.append((sources, posixpath.normpath(posixpath.join(ins.workdir, dest))))
    return out


def test_targets_outside_the_distribution_are_on_the_image_path(
        services: dict[str, Any], dockerfile: list[Instruction],
        pyproject: dict[str, Any]) -> None:
    """pyproject packages only mtq*; a target in another package (examples.*) must be
    copied into a directory on PYTHONPATH, or the worker cannot import it."""
    include = (pyproject.get("tool", {}).get("setuptools", {}).get("packages", {})
               .get("find", {}).get("include", ["*"]))
    pythonpath = [p for p in dockerfile[-1].env.get("PYTHONPATH", "").split(":") if p]
    for name in WORKERS:
        target = parse_mtq(command_of(services, name), name).params["target"]
        package = target.split(":")[0].split(".")[0]
        if any(fnmatch.fnmatch(package, pat) for pat in include):
            continue  # installed with the package
        places = []
        for sources, dest in _copies(dockerfile):
            for src in sources:
                src = src.rstrip("/")
                if src == package:
                    places.append(dest)
                elif src in (".", "./"):
                    places.append(posixpath.join(dest, package))
        on_path = [p for p in places if posixpath.dirname(p) in pythonpath]
        assert on_path, (
            f"Dockerfile: {name}'s target {target!r} is in {package!r}, which the "
            f"distribution does not include: COPY {package} into a directory on PYTHONPATH "
            f"(e.g. WORKDIR /app, COPY {package} ./{package}, ENV PYTHONPATH=/app); copies "
            f"found: {places}, PYTHONPATH: {pythonpath}")


def test_dockerignore_keeps_the_build_inputs(dockerfile: list[Instruction]) -> None:
    assert DOCKERIGNORE.is_file(), f"{DOCKERIGNORE} is missing: keep .git and caches out"
    patterns = [line.strip() for line in DOCKERIGNORE.read_text().splitlines()
                if line.strip() and not line.strip().startswith(("#", "!"))]
    assert ".git" in patterns, ".dockerignore: add .git"

    def ignored(path: str) -> str | None:
        parts = path.strip("/").split("/")
        for pat in patterns:
            pat = pat.strip("/")
            for k in range(1, len(parts) + 1):
                prefix = "/".join(parts[:k])
                if fnmatch.fnmatch(prefix, pat) or (pat.startswith("**/") and
                                                    fnmatch.fnmatch(parts[k - 1], pat[3:])):
                    return pat
        return None

    for sources, _ in _copies(dockerfile):
        for src in sources:
            if src in (".", "./"):
                continue
            pat = ignored(src)
            assert pat is None, (
                f".dockerignore: {pat!r} excludes {src!r}, which the Dockerfile copies")
            assert (ROOT / src).exists(), f"Dockerfile: COPY {src}: no such path in the repo"
