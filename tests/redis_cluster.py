"""A private Redis Cluster on loopback for the cluster tests: three masters, no replicas, in a temp dir.

Each master is a ``redis-server --cluster-enabled yes`` on a free port; ``redis-cli --cluster create``
joins them and the cluster is used once every node says ``cluster_state:ok``. A master can be killed
(SIGKILL: a lost machine, not a clean shutdown) and started again on its port and node file, so it
rejoins with its slots and no data (``--appendonly no --save ''``: it comes back empty).

``cluster-require-full-coverage no``: the masters left keep serving their slots while one is down,
which is what a deployment without replicas must set for sessions on live shards to keep working.
A short node timeout: the survivors flag a killed master failed, and agree on it back, within seconds.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import time

import pytest
from serving_helpers import free_port

from tiers.store.redis.keys import owner_key

NODE_TIMEOUT_MS = 1000


def missing_reason() -> str | None:
    """Why a local cluster cannot start here, or None."""
    for tool in ("redis-server", "redis-cli"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    return None


class RedisCluster:
    def __init__(self, dir: str, masters: int = 3):
        self.dir = str(dir)
        self.ports = [free_port() for _ in range(masters)]
        # Each node's cluster bus on a free port of its own: the default (port + 10000) may be taken, or
        # past 65535 for a high free port.
        self.bus_ports = {port: free_port() for port in self.ports}
        self.procs: dict[int, subprocess.Popen] = {}

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def client(self, port: int | None = None):
        """A plain (not cluster-aware) client of one node: for CLUSTER commands and counts on that node."""
        import redis

        return redis.Redis(port=port or self.ports[0], socket_connect_timeout=2, socket_timeout=5)

    def cluster_client(self):
        import redis.cluster

        return redis.cluster.RedisCluster(host="127.0.0.1", port=self.ports[0], socket_timeout=5)

    def start_node(self, port: int) -> None:
        node_dir = os.path.join(self.dir, str(port))
        os.makedirs(node_dir, exist_ok=True)
        log = open(os.path.join(node_dir, "redis.log"), "ab")
        self.procs[port] = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", node_dir,
             "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
             "--cluster-port", str(self.bus_ports[port]),
             "--cluster-node-timeout", str(NODE_TIMEOUT_MS), "--cluster-require-full-coverage", "no",
             "--appendonly", "no", "--save", ""],
            stdout=log, stderr=subprocess.STDOUT,
        )
        log.close()
        self._wait(lambda: self.client(port).ping(), f"redis-server on {port} did not start")

    def kill_node(self, port: int) -> None:
        proc = self.procs.pop(port)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)

    def node_of(self, key: str) -> int:
        """The port of the master that serves ``key``'s slot (as the cluster says)."""
        slot = self.client().cluster("keyslot", key)
        for start, end, master, *_ in self.client().cluster("slots"):
            if start <= slot <= end:
                return int(master[1])
        raise LookupError(f"slot {slot} is not served")

    def state_ok(self, port: int | None = None) -> bool:
        with contextlib.suppress(Exception):
            return self.client(port).cluster("info")["cluster_state"] == "ok"
        return False

    def wait_ok(self, timeout: float = 30) -> None:
        self._wait(lambda: all(self.state_ok(p) for p in self.procs), "the cluster did not reach cluster_state:ok",
                   timeout)

    @staticmethod
    def _wait(ready, message: str, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(Exception):
                if ready():
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(message)
            time.sleep(0.05)

    def __enter__(self) -> "RedisCluster":
        try:
            for port in self.ports:
                self.start_node(port)
            subprocess.run(
                ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
                 "--cluster-replicas", "0", "--cluster-yes"],
                check=True, capture_output=True, timeout=60,
            )
            self.wait_ok()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for port in list(self.procs):
            with contextlib.suppress(Exception):
                self.kill_node(port)


@contextlib.contextmanager
def local_cluster(dir):
    """A started cluster (its files in ``dir``) for a ``with`` block; the test skips, saying why, where one
    cannot start."""
    reason = missing_reason()
    if reason is not None:
        pytest.skip(f"needs a local Redis Cluster: {reason}")
    cluster = RedisCluster(dir)
    try:
        cluster.__enter__()
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        pytest.skip(f"needs a local Redis Cluster: it did not start ({type(exc).__name__}: {exc})")
    try:
        yield cluster
    finally:
        cluster.__exit__()


def namespace_on_one_node(cluster: RedisCluster, prefix: str) -> str:
    """A fresh key namespace whose cross-session keys (the listing index of sessions without an owner, the
    replicas' totals) sit on one node, so that a test can kill another and know what must still answer."""
    for _ in range(1000):
        ns = f"{prefix}-{secrets.token_hex(3)}"
        if cluster.node_of(owner_key(ns, None)) == cluster.node_of(f"{ns}:replicas"):
            return ns
    raise RuntimeError("no namespace puts the index and the replicas' totals on one node")
