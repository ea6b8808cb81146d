"""The soak's infrastructure against real processes: the cut/slow TCP proxy, the three Redis topologies'
faults (a crash that keeps what was fsynced, sentinel and cluster failovers that lose nothing) and a chat
replica's network namespace, end to end (root only)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis_sentinel import RedisSentinel, missing_reason

from bench.redis_node import wait_for
from bench.soak_net import REDIS_HOST, HostAddress, ReplicaNet, available, cleanup_stale, pause
from bench.soak_procs import free_port
from bench.soak_redis import ClusterTopology, SentinelTopology, SingleTopology
from bench.tcp_proxy import ProxyProcess

pytestmark = pytest.mark.skipif(missing_reason() is not None, reason=f"needs redis-server: {missing_reason()}")


def quick_client(port: int, host: str = "127.0.0.1") -> redis.Redis:
    """Half-second timeouts and no retries: a cut shows as one TimeoutError."""
    return redis.Redis(host=host, port=port, socket_timeout=0.5, socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))


def ping_s(client: redis.Redis) -> float:
    t0 = time.monotonic()
    client.ping()
    return time.monotonic() - t0


@pytest.fixture
def single(tmp_path):
    with SingleTopology(tmp_path / "single") as topology:
        yield topology


def test_proxy_forwards_slows_and_cuts_silently(single, tmp_path):
    port = free_port()
    with ProxyProcess([("127.0.0.1", port, "127.0.0.1", single.node.port)], tmp_path / "p.sock",
                      tmp_path / "p.log") as proxy:
        client = quick_client(port)
        client.set("k", "v")
        assert client.get("k") == b"v"

        proxy.slow(0.2)  # a request and its reply: two chunks delayed
        assert ping_s(client) >= 0.38
        proxy.heal()
        assert ping_s(client) < 0.3

        assert proxy.cut()["mode"] == "cut"
        with pytest.raises(redis.TimeoutError):  # mute, not reset: the client waits out its timeout
            client.ping()
        with pytest.raises(redis.TimeoutError):  # a new connection is accepted and held mute too
            quick_client(port).ping()
        assert single.primaries()[0].ping()  # Redis itself is fine
        proxy.heal()
        assert client.get("k") == b"v"  # a fresh connection after the heal

        proxy.cut(seconds=0.3)  # heals by itself
        time.sleep(0.6)
        assert client.get("k") == b"v"
        stats = proxy.stats()
        assert stats["mode"] == "pass" and stats["bytes_up"] > 0 and stats["bytes_down"] > 0
        assert stats["connections"] >= 3 and stats["cut_connections"] >= 2
    assert proxy.proc.returncode is not None


def test_single_crash_keeps_what_was_fsynced(single):
    with pytest.raises(NotImplementedError):
        single.failover()
    single.primaries()[0].set("rkv-test:old", "1")
    time.sleep(2.2)  # appendfsync everysec: on disk by now
    single.primaries()[0].set("rkv-test:new", "1")  # may or may not survive
    report = single.crash()
    assert report["old_primary"] == report["new_primary"] == single.node.port and report["writable_s"] < 30
    client = single.primaries()[0]
    assert client.get("rkv-test:old") == b"1"
    assert client.set("rkv-test:after", "1")


def test_sentinel_failover_and_crash_lose_no_replicated_write(tmp_path):
    with RedisSentinel(tmp_path / "sentinel") as deployment:
        topology = deployment.topology
        ports = [s.port for s in topology.sentinels]
        assert deployment.url == "redis+sentinel://" + ",".join(f"127.0.0.1:{p}" for p in ports) + "/rkv"
        sentinel = redis.sentinel.Sentinel([("127.0.0.1", p) for p in ports], socket_timeout=2)
        primary = sentinel.master_for("rkv", socket_timeout=2)
        primary.set("k1", "1")

        first = deployment.primary_port()
        assert first == deployment.ports[0]
        assert deployment.failover() != first
        primary.set("k2", "2")  # the pool follows the sentinels to the new primary
        assert deployment.client().get("k1") == b"1"

        report = topology.crash()
        assert report["old_primary"] != report["new_primary"] == deployment.primary_port()
        assert topology.nodes[report["old_primary"]].role() == "slave"
        for _ in range(50):  # the pool's connection to the killed node fails once, then it asks again
            try:
                primary.set("k3", "3")
                break
            except redis.ConnectionError:
                time.sleep(0.1)
        assert [deployment.client().get(k) for k in ("k1", "k2", "k3")] == [b"1", b"2", b"3"]

        killed = deployment.kill_primary()
        wait_for(lambda: deployment.primary_port() != killed, "the replica promoted")
        deployment.start_node(killed)
        assert deployment.client(killed).ping()


def test_cluster_failover_and_crash(tmp_path):
    with ClusterTopology(tmp_path / "cluster") as topology:
        assert topology.url.startswith("redis+cluster://127.0.0.1:") and len(topology.endpoints()) == 6
        client = redis.cluster.RedisCluster(host="127.0.0.1", port=topology.endpoints()[0][1], socket_timeout=2)
        for i in range(30):
            client.set(f"k{i}", i)
        report = topology.failover()
        assert report["old_primary"] != report["new_primary"] and report["slots"] == [0, 5460]
        report = topology.crash()  # the next shard in turn
        assert report["slots"][0] == 5461 and topology.nodes[report["old_primary"]].role() == "slave"
        # Whatever was written more than a second before the crash is there (replicated, if not fsynced).
        assert [client.get(f"k{i}") for i in range(30)] == [str(i).encode() for i in range(30)]
        assert len(topology.primaries()) == 3


INSIDE = """
import json, os, sys
import redis, redis.cluster, redis.sentinel
from redis.backoff import NoBackoff
from redis.retry import Retry
args = json.loads(sys.argv[1])
host, opts = args["host"], dict(socket_timeout=1, socket_connect_timeout=1)
r = redis.Redis(host=host, port=args["single"], retry=Retry(NoBackoff(), 0), **opts)
r.set("k", "single")
assert r.get("k") == b"single"
if "sentinels" in args:
    s = redis.sentinel.Sentinel([(host, p) for p in args["sentinels"]], **opts).master_for("rkv", **opts)
    s.set("k", "sentinel")
    assert s.get("k") == b"sentinel"
    c = redis.cluster.RedisCluster(host=host, port=args["cluster"], **opts)
    for i in range(20):  # keys on every shard: redirects to every master, through the proxy
        c.set(f"k{i}", i)
    assert [c.get(f"k{i}") for i in range(20)] == [str(i).encode() for i in range(20)]
print(json.dumps({"pid": os.getpid()}))
"""


def serves(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def run_inside(net: ReplicaNet, script: Path, args: dict) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(net.wrap([sys.executable, str(script), json.dumps(args)]),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=60)
    if proc.returncode == 0:  # `ip netns exec` execs: the program keeps the PID we started
        assert json.loads(out)["pid"] == proc.pid
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.skipif(available() is not None, reason=f"needs network namespaces: {available()}")
def test_replica_namespace_reaches_every_topology_through_its_proxy(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"rkvsoak251-{dead.pid}-abcdef"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    assert stale in cleanup_stale()

    script = tmp_path / "inside.py"
    script.write_text(INSIDE)
    with HostAddress() as address, SingleTopology(tmp_path / "single", host=REDIS_HOST) as single, \
            SentinelTopology(tmp_path / "sentinel", host=REDIS_HOST) as sentinel, \
            ClusterTopology(tmp_path / "cluster", host=REDIS_HOST) as cluster:
        endpoints = single.endpoints() + sentinel.endpoints() + cluster.endpoints()
        with ReplicaNet(250, endpoints, tmp_path / "net") as net:
            args = {"host": REDIS_HOST, "single": single.node.port, "sentinels": [s.port for s in sentinel.sentinels],
                    "cluster": cluster.endpoints()[0][1]}
            done = run_inside(net, script, args)
            assert done.returncode == 0, done.stderr

            net.cut()
            single_only = {"host": REDIS_HOST, "single": single.node.port}
            cut = run_inside(net, script, single_only)
            assert cut.returncode != 0 and "TimeoutError" in cut.stderr
            assert single.primaries()[0].ping()  # the root namespace still reaches Redis
            net.heal()
            assert run_inside(net, script, single_only).returncode == 0
            stats = net.stats()
            assert stats["connections"] > 3 and stats["cut_connections"] >= 1 and stats["bytes_down"] > 0

            # The replica's HTTP side: reached from here at replica_host; a pause freezes it.
            port = free_port()
            server = subprocess.Popen(net.wrap([sys.executable, "-m", "http.server", str(port), "--bind", "0.0.0.0"]),
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path)
            try:
                url = f"http://{net.replica_host}:{port}/"
                wait_for(lambda: serves(url), "http.server in the namespace")
                assert Path(f"/proc/{server.pid}/cmdline").read_bytes().split(b"\0")[1:3] == [b"-m", b"http.server"]
                frozen = threading.Thread(target=pause, args=(server.pid, 1.5))
                frozen.start()
                time.sleep(0.2)
                with pytest.raises(httpx.TimeoutException):
                    httpx.get(url, timeout=0.5)
                frozen.join()
                assert httpx.get(url, timeout=2).status_code == 200
            finally:
                server.kill()
                server.wait()
            added = address.added
        assert net.netns not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert subprocess.run(["ip", "link", "show", net.veth_host], capture_output=True).returncode != 0
    if added:
        assert f" {REDIS_HOST}/" not in subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
    assert os.path.exists(tmp_path / "net" / "proxy250.log")
