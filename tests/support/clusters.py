"""Real Redis Cluster and Sentinel deployments on loopback, for the scale-out tests.

* :class:`Cluster`: 3 primaries and 3 replicas (``redis-server --cluster-enabled yes``,
  joined with ``redis-cli --cluster create ... --cluster-replicas 1``), a
  ``cluster-node-timeout`` of 1 s so that a replica takes over within seconds.
* :class:`SentinelSet`: one primary, one replica and three sentinels.

Both use Debian's Redis 7 (sharded pub/sub needs 7; the embedded 6.2 has no cluster
support worth testing), found by :func:`tests.support.servers.find_redis7`.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tests.support.servers import find_redis7

#: how long a node waits before it calls a silent peer failed (ms): failover in seconds
from tests.support.waits import wait_for

#: how long a node waits before it calls a silent peer failed (ms): failover in seconds
NODE_TIMEOUT_MS = 1000


_TAKEN: set[int] = set()  # ports handed out in this process: never twice


def free_cluster_port() -> int:
    """A free loopback port whose cluster bus port (+10000) is free too."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port + 10000 > 65535 or port in _TAKEN or port + 10000 in _TAKEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        _TAKEN.update((port, port + 10000))
        return port
    raise RuntimeError("no free pair of ports (port, port + 10000) on loopback")


class Node:
    """One redis-server process of a cluster or a sentinel set."""

    def __init__(self, binary: str, port: int, directory: Path, *args: str,
                 sentinel: bool = False) -> None:
        self.binary, self.port, self.dir, self.args = binary, port, directory, args
        self.sentinel = sentinel
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        data = [] if self.sentinel else ["--save", "", "--appendonly", "no"]
        self.proc = subprocess.Popen(
            [self.binary, *self.args, "--port", str(self.port), "--bind", "127.0.0.1",
             *data, "--dir", str(self.dir), "--logfile", "redis.log"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # polled: no retries of its own (redis-py backs off for seconds between them)
        probe = redis.Redis(port=self.port, socket_timeout=2, retry=Retry(NoBackoff(), 0))

        def up() -> bool:
            try:
                return bool(probe.ping())
            except redis.exceptions.ConnectionError:
                assert self.proc is not None and self.proc.poll() is None, \
                    f"redis-server on port {self.port} exited: {self.log()[-2000:]}"
                return False

        wait_for(up, 10, f"redis-server on port {self.port} did not accept connections")
        probe.close()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crashed host would go."""
        if self.alive:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.alive:
            assert self.proc is not None
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=5)

    def log(self) -> str:
        try:
            return (self.dir / "redis.log").read_text(errors="replace")
        except OSError:
            return ""


class Cluster:
    """3 primaries with ``replicas`` replicas each, on free loopback ports."""

    def __init__(self, tmp: Path, primaries: int = 3, replicas: int = 1) -> None:
        self.binary = find_redis7()
        self.cli = shutil.which("redis-cli", path=os.path.dirname(self.binary)) or "redis-cli"
        self.nodes = [
            Node(self.binary, port, tmp / str(port), "--cluster-enabled", "yes",
                 "--cluster-config-file", "nodes.conf",
                 "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
                 # a replica of a dead primary takes over however long it was cut off
                 "--cluster-replica-validity-factor", "0")
            for port in (free_cluster_port() for _ in range(primaries * (1 + replicas)))]
        self.replicas = replicas

    @property
    def url(self) -> str:
        """The mtq URL of the cluster (every node named: any one is enough)."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self) -> None:
        for n in self.nodes:
            n.start()
        if len(self.nodes) == 1:  # a cluster of one node (redis-cli wants three)
            c = self.nodes[0].client()
            try:
                c.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
            finally:
                c.close()
            self.wait_ok()
            return
        subprocess.run([self.cli, "--cluster", "create",
                        *(f"127.0.0.1:{n.port}" for n in self.nodes),
                        "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                       check=True, capture_output=True, timeout=60)
        self.wait_ok()

    def wait_ok(self, timeout: float = 30) -> None:
        """Until every live node sees the cluster ok and every primary has its replicas."""
        def ok() -> bool:
            for n in self.nodes:
                if not n.alive:
                    continue
                c = n.client()
                try:
                    if c.cluster("INFO").get("cluster_state") != "ok":
                        return False
                except redis.exceptions.RedisError:
                    return False
                finally:
                    c.close()
            return len(self.primaries()) * self.replicas <= len(self.live_replicas())
        wait_for(ok, timeout, "the cluster did not become ok")

    def _role(self, n: Node) -> str:
        c = n.client()
        try:
            return c.execute_command("ROLE")[0].decode()
        except redis.exceptions.RedisError:
            return "?"
        finally:
            c.close()

    def primaries(self) -> list[Node]:
        return [n for n in self.nodes if n.alive and self._role(n) == "master"]

    def live_replicas(self) -> list[Node]:
        out = []
        for n in self.nodes:
            if n.alive and self._role(n) == "slave":
                c = n.client()
                try:
                    if c.info("replication").get("master_link_status") == "up":
                        out.append(n)
                finally:
                    c.close()
        return out

    def owner(self, key: str) -> Node:
        """The live primary that serves ``key``'s slot now."""
        c = self.primaries()[0].client()
        try:
            slot = int(c.execute_command("CLUSTER", "KEYSLOT", key))
            for lo, hi, primary, *_ in c.execute_command("CLUSTER", "SLOTS"):
                if lo <= slot <= hi:
                    port = int(primary[1])
                    return next(n for n in self.nodes if n.port == port)
        finally:
            c.close()
        raise AssertionError(f"no node serves {key!r}")

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()


class SentinelSet:
    """One primary, ``replicas`` replicas, three sentinels watching them as ``service``
    (with two replicas, the new primary after a failover still has one, so durable
    submits are confirmed again at once)."""

    def __init__(self, tmp: Path, service: str = "mtqmain", replicas: int = 2) -> None:
        self.binary = find_redis7()
        self.service = service
        primary_port = free_cluster_port()
        self.primary = Node(self.binary, primary_port, tmp / "primary")
        self.replicas = [Node(self.binary, free_cluster_port(), tmp / f"replica{i}",
                              "--replicaof", "127.0.0.1", str(primary_port))
                         for i in range(replicas)]
        self.sentinels: list[Node] = []
        self.tmp = tmp

    @property
    def url(self) -> str:
        ports = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{ports}/{self.service}"

    def start(self) -> None:
        self.primary.start()
        for r in self.replicas:
            r.start()
        for i in range(3):
            port = free_cluster_port()
            d = self.tmp / f"sentinel{i}"
            d.mkdir(parents=True, exist_ok=True)
            conf = d / "sentinel.conf"
            conf.write_text("\n".join([
                f"sentinel monitor {self.service} 127.0.0.1 {self.primary.port} 2",
                f"sentinel down-after-milliseconds {self.service} 1000",
                f"sentinel failover-timeout {self.service} 5000",
                f"sentinel parallel-syncs {self.service} 1", ""]))
            node = Node(self.binary, port, d, str(conf), "--sentinel", sentinel=True)
            self.sentinels.append(node)
            node.start()
        for r in self.replicas:
            replica = r.client()

            def synced(c: redis.Redis = replica) -> bool:
                return bool(c.info("replication").get("master_link_status") == "up")

            try:
                wait_for(synced, 20, "a replica did not sync with the primary")
            finally:
                replica.close()

    def current_primary_port(self) -> int | None:
        for s in self.sentinels:
            if not s.alive:
                continue
            c = s.client()
            try:
                addr = c.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service)
                if addr:
                    return int(addr[1])
            except redis.exceptions.RedisError:
                continue
            finally:
                c.close()
        return None

    def stop(self) -> None:
        for n in [*self.sentinels, *self.replicas, self.primary]:
            n.stop()
