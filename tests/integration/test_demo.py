"""The demo (the README's first command) against the test server."""

from __future__ import annotations

import pytest

from mtq.demo import run_demo

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def test_demo_survives_a_killed_worker_and_keeps_order(redis_url: str) -> None:
    messages: list[str] = []
    report = run_demo(redis_url, tasks=120, streams=12, workers=2, lease_ms=800,
                      progress=messages.append)
    assert report.ok, (report.order_errors, report.other)
    assert report.succeeded == 120 and report.order_ok
    assert report.killed_pid is not None and report.redelivered > 0
    assert any("SIGKILL" in m for m in messages)


def test_demo_without_kill(redis_url: str) -> None:
    report = run_demo(redis_url, tasks=60, streams=5, workers=1, kill_one=False)
    assert report.ok and report.killed_pid is None and report.redelivered == 0


def test_demo_chats_stream_tokens_in_order(redis_url: str, tmp_path, monkeypatch) -> None:
    from mtq.demo import run_chat

    monkeypatch.setenv("MTQ_REFERENCE_WEIGHTS", str(tmp_path / "tinygpt.pt"))
    pieces: list[str] = []
    report = run_chat(redis_url, users=3, chats_per_user=2, max_tokens=12, echo=pieces.append)
    assert not report.skipped
    assert report.ok and report.succeeded == 6 and report.tokens == 6 * 12
    assert report.order_ok and report.streamed_matches_result
    assert pieces.count("\n") == 2  # user-0's two chats were echoed live
