"""CPU meters (a process, redis-server, the machine) and the statistics of a run."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import redis

_HZ = os.sysconf("SC_CLK_TCK")

#: a step measured while other processes used more of the machine is noisier
MAX_FOREIGN = 0.15


# -- statistics --------------------------------------------------------------------------
def pct(values: Sequence[float], q: float, nearest: bool = False) -> float:
    """The q-th percentile (0..100) of ``values``, interpolated linearly, or with
    ``nearest`` the sample at rank ``int(n * q / 100)`` (the peer harness's way)."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    if nearest:
        return ordered[min(len(ordered) - 1, int(len(ordered) * q / 100))]
    k = (len(ordered) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def median(values: Sequence[float]) -> float:
    return pct(values, 50)


def rate(n: float, seconds: float) -> float:
    return n / seconds if seconds > 0 else float("inf")


def paired_ratio(now: Sequence[float], ref: Sequence[float]) -> float:
    """The median of the per-pass ratios ``now[i] / ref[i]`` (passes taken in turns)."""
    return median([n / r for n, r in zip(now, ref) if r])


def spread(values: Sequence[float], digits: int = 0) -> str:
    """'; median of k (range min-max)' to end a note; empty for a single run."""
    if len(values) < 2:
        return ""
    return f"; median of {len(values)} (range {min(values):,.{digits}f}-{max(values):,.{digits}f})"


def ms_stats(values: Sequence[float]) -> str:
    """'p50 a, p90 b, p99 c, max d ms over n' of values in ms."""
    return (f"p50 {pct(values, 50):.3f}, p90 {pct(values, 90):.3f}, p99 {pct(values, 99):.3f}, "
            f"max {max(values):.2f} ms over {len(values):,}")


# -- CPU ---------------------------------------------------------------------------------
def proc_cpu(pid: int) -> float:
    """User + system CPU seconds of a live process and of the children it reaped."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    rest = text[text.rfind(")") + 2:].split()  # the command name may contain spaces
    return sum(float(x) for x in rest[11:15]) / _HZ


def threads_cpu(pid: int) -> float:
    """CPU seconds of the live threads of ``pid``, in nanoseconds from each thread's
    schedstat (finer than /proc/PID/stat's clock ticks; threads that ended are not
    counted)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            pass  # a thread that just ended
    return total / 1e9


def redis_cpu(r: redis.Redis) -> float:
    """redis-server's user + system CPU seconds so far (INFO cpu)."""
    info = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def commandstats(r: redis.Redis, field: str = "calls") -> dict[str, int]:
    """One field of INFO commandstats (``calls``, ``usec``) by command name."""
    return {k.removeprefix("cmdstat_"): int(v[field]) for k, v in r.info("commandstats").items()}


def machine_busy() -> float:
    """CPU seconds the whole machine has been busy (all cores), from /proc/stat."""
    try:
        v = [float(x) for x in Path("/proc/stat").read_text().split()[1:9]]
    except OSError:
        return 0.0
    return (sum(v) - v[3] - v[4]) / _HZ  # less idle and iowait


def descendants(pid: int) -> list[int]:
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = list(Path(f"/proc/{p}/task").iterdir())
        except OSError:
            continue
        for t in tasks:
            try:
                kids = [int(k) for k in (t / "children").read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def our_cpu() -> float:
    """CPU seconds used by this process and everything it started, reaped or running."""
    t = os.times()
    return (t.user + t.system + t.children_user + t.children_system
            + sum(proc_cpu(d) for d in descendants(os.getpid())))


Mark = tuple[float, float, float]


def cpu_mark() -> Mark:
    return time.perf_counter(), machine_busy(), our_cpu()


def foreign(mark: Mark) -> tuple[float, float]:
    """(wall seconds, share of the machine other processes used) since ``mark``."""
    wall = time.perf_counter() - mark[0]
    other = max(0.0, (machine_busy() - mark[1]) - (our_cpu() - mark[2]))
    return wall, other / max(wall * (os.cpu_count() or 1), 1e-9)


def wait_quiet(limit_s: float, share: float = MAX_FOREIGN) -> float:
    """Wait (at most ``limit_s``) until other processes use less than ``share`` of the
    machine over a 0.5 s window; returns the seconds waited."""
    t0 = time.perf_counter()
    while True:
        mark = cpu_mark()
        time.sleep(0.5)
        if foreign(mark)[1] < share or time.perf_counter() - t0 > limit_s:
            return time.perf_counter() - t0


class CpuMeter:
    """How much of the machine other processes took while each step ran."""

    def __init__(self) -> None:
        self.steps: list[tuple[str, float, float]] = []  # name, wall s, foreign share

    def add(self, name: str, mark: Mark) -> tuple[float, float]:
        wall, share = foreign(mark)
        self.steps.append((name, wall, share))
        return wall, share

    def run(self, steps: Sequence[tuple[str, Callable[[], Any]]], quiet_s: float = 0) -> None:
        """Run the steps in order, each after waiting (at most ``quiet_s``) for a quiet
        machine, and measure each."""
        for name, step in steps:
            if quiet_s:
                wait_quiet(quiet_s)
            mark = cpu_mark()
            print(f"running {name}...", end=" ", flush=True)
            step()
            wall, share = self.add(name, mark)
            print(f"{wall:.1f} s (other processes: {share:.0%} of the CPU)", flush=True)

    def share(self) -> float:
        wall = sum(w for _, w, _ in self.steps)
        return sum(w * f for _, w, f in self.steps) / max(wall, 1e-9)


# -- the machine -------------------------------------------------------------------------
def machine_info(r: redis.Redis | None = None, *extra: str) -> str:
    """One line: cores and CPU model, Python, redis-py, the server's version and
    allocator, and ``extra`` (torch, say)."""
    cpu = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    parts = [f"{os.cpu_count()} cores ({cpu})", f"Python {platform.python_version()}",
             f"redis-py {redis.__version__}"]
    if r is not None:
        info = r.info("server")
        mem = r.info("memory").get("mem_allocator", "?")
        parts.append(f"redis-server {info['redis_version']} ({mem})")
    return ", ".join([*parts, *extra])


def torch_info() -> str:
    import torch

    return f"torch {torch.__version__} ({torch.get_num_threads()} threads)"
