"""mtq.workers.localproc.wait_exit: a blocking wait for processes that are not this
one's children (pidfds), bounded by its timeout."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from mtq.workers.localproc import wait_exit, wait_group


def test_it_returns_when_a_process_that_is_not_a_child_exits() -> None:
    # a grandchild: the shell's child, not ours, killed when the shell says so
    sh = subprocess.Popen(["sh", "-c", "sleep 1 & echo $!; wait"], stdout=subprocess.PIPE,
                          text=True)
    assert sh.stdout is not None
    pid = int(sh.stdout.readline())
    t = time.monotonic()
    wait_exit([pid], 10)
    took = time.monotonic() - t
    assert 0.1 < took < 5, took
    try:  # ended: gone, or a zombie its shell has not reaped yet
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        state = "gone"
    assert state in ("gone", "Z", "X"), state
    sh.wait(5)


def test_it_keeps_to_its_timeout_and_takes_pids_already_gone() -> None:
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        t = time.monotonic()
        wait_exit([p.pid, 2**22 + 12345], 0.3)
        assert 0.25 < time.monotonic() - t < 3
        assert p.poll() is None
    finally:
        p.kill()
        p.wait(5)


def test_wait_group_waits_for_every_member_of_the_group() -> None:
    p = subprocess.Popen(["sh", "-c", "sleep 0.4 & sleep 0.2; exit 0"], start_new_session=True)
    p.wait(5)  # the leader is gone; its background sleep is still in the group
    assert wait_group(p.pid, 10) == []
