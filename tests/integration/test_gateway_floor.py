"""benchmarks.gateway's floor (benchmarks/children/sse_floor.py) under uvicorn: the
streams the benchmark compares the gateway with are OpenAI's chunks, read by the
openai SDK, every token in order, and their hand-over times are kept."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from tests.support.gateway import stop
from tests.support.paths import ROOT
from tests.support.processes import free_port
from tests.support.waits import wait_for

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.timeout(60)


def test_the_floor_streams_openai_chunks_at_its_pace(tmp_path: Path) -> None:
    port = free_port()
    with open(tmp_path / "floor.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "benchmarks.children.sse_floor",
                                 str(port)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    gate = tmp_path / "gate"
    prompt = f"n=4 step_ms=10 every=2 gate={gate}"
    try:
        def up() -> bool:
            assert proc.poll() is None, (tmp_path / "floor.log").read_text()
            try:
                return httpx.get(base + "/v1/models", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(up, 30, "the floor app did not come up")
        got: dict[int, list[object]] = {}

        def read(k: int) -> None:
            with openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0) as c:
                got[k] = list(c.chat.completions.create(
                    model="floor", messages=[{"role": "user", "content": prompt}],
                    stream=True))

        readers = [threading.Thread(target=read, args=(k,)) for k in range(3)]
        for t in readers:
            t.start()
        wait_for(lambda: len(httpx.get(base + "/pushes").json()) == 3, 10,
                 "three streams did not open")
        assert all(v == [] for v in httpx.get(base + "/pushes").json().values()), \
            "a token went out before the gate opened"
        gate.touch()
        for t in readers:
            t.join(20)
            assert not t.is_alive(), "a stream did not end"
        pushes = httpx.get(base + "/pushes").json()
    finally:
        stop(proc)
    for chunks in got.values():
        assert chunks[0].choices[0].delta.role == "assistant"  # type: ignore[attr-defined]
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks)  # type: ignore[attr-defined]
        assert text == "t0 t1 t2 t3 "
        assert chunks[-1].choices[0].finish_reason == "length"  # type: ignore[attr-defined]
        stream_id = chunks[0].id.split("-", 1)[1]  # type: ignore[attr-defined]
        times = [ts for _, ts in pushes[stream_id]]
        assert [i for i, _ in pushes[stream_id]] == [0, 1, 2, 3]
        assert times == sorted(times) and len(set(times)) == 4, times  # one a step
