"""The Redis topologies ``bench soak`` runs its chat replicas against, one interface for all three: a
single ``redis-server``, a primary and replica watched by three Sentinels, and a Redis Cluster of three
masters with a replica each. Every process listens on ``host`` only (the soak passes
``soak_net.REDIS_HOST``; tests use 127.0.0.1) and advertises that address, so every address a client is
handed is ``host:<port>``, one of ``endpoints()``.

Faults: ``failover()`` is a planned switch to a replica that loses nothing; ``crash()`` SIGKILLs a primary,
so it loses what its AOF had not fsynced (up to a second), lets the topology recover, and starts the
killed node again. Both return once the topology is whole again (every node up, every replica in sync,
ready for the next fault), with a dict of what happened: ``fault``, ``old_primary`` and ``new_primary``
(ports), ``writable_s`` (from the fault until the new primary took a write) and ``whole_s``.
"""
from __future__ import annotations

import subprocess
import time
from abc import abstractmethod
from pathlib import Path

import redis
from redis.crc import key_slot

from bench.lifecycle import Lifecycle
from bench.redis_node import WAIT_S, Node, data_conf, wait_for
from bench.soak_procs import free_port

PROBE = "soak-probe"  # written to check a primary takes writes: outside the sessions' namespace


class Topology(Lifecycle):
    """What the soak needs of a Redis deployment. ``nodes``: the data nodes by port; ``sentinels``: any
    other process a client talks to. ``start`` returns once clients can use it and its faults can run; a
    ``with`` block starts it and closes it."""

    def __init__(self, dir: Path, host: str = "127.0.0.1", maxmemory: str | None = None):
        self.dir, self.host, self.maxmemory = Path(dir), host, maxmemory
        self.nodes: dict[int, Node] = {}
        self.sentinels: list[Node] = []

    @property
    @abstractmethod
    def url(self) -> str:
        """A chat replica's ``RKV_REDIS_URL``."""

    @abstractmethod
    def primaries(self) -> list[redis.Redis]:
        """A plain client of each current primary: together they hold every key."""

    def failover(self) -> dict:
        """A planned failover, nothing lost; returns once the new primary takes writes."""
        raise NotImplementedError(f"{type(self).__name__} has no replica to fail over to")

    @abstractmethod
    def crash(self) -> dict:
        """SIGKILL a primary (its last second of writes lost), recover, start it again."""

    def endpoints(self) -> list[tuple[str, int]]:
        """(host, port) of every process a chat replica may connect to."""
        return [(self.host, n.port) for n in [*self.nodes.values(), *self.sentinels]]

    def _node(self, name: str, conf: list[str], sentinel: bool = False) -> Node:
        port = free_port()
        return Node(self.dir / f"{name}-{port}", self.host, port, conf, sentinel=sentinel)

    def _wait(self, ready, what: str, timeout: float = WAIT_S):
        return wait_for(ready, what, timeout, [*self.nodes.values(), *self.sentinels])

    def close(self) -> None:
        """Stop every process: SIGTERM to all at once, then SIGKILL any still running after 10 s."""
        every = [*self.sentinels, *self.nodes.values()]
        for node in every:
            if node.alive:
                node.proc.terminate()
        for node in every:
            node.stop()


def _writable(client: redis.Redis, key: str = PROBE) -> bool:
    return bool(client.set(key, str(time.time()), ex=60))


class SingleTopology(Topology):
    """One ``redis-server``. ``crash`` restarts it at once on its port and folder, from its AOF."""

    def __init__(self, dir: Path, host: str = "127.0.0.1", maxmemory: str | None = None):
        super().__init__(dir, host, maxmemory)
        self.node = self._node("redis", data_conf(maxmemory))
        self.nodes = {self.node.port: self.node}

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.node.port}/0"

    def start(self) -> None:
        self.node.start()

    def primaries(self) -> list[redis.Redis]:
        return [self.node.client(timeout=30)]

    def crash(self) -> dict:
        t0 = time.monotonic()
        self.node.kill()
        self.node.start()
        self._wait(lambda: _writable(self.node.client()), f"{self.node} takes writes after its restart")
        took = round(time.monotonic() - t0, 2)
        return {"fault": "crash", "old_primary": self.node.port, "new_primary": self.node.port,
                "writable_s": took, "whole_s": took}


class SentinelTopology(Topology):
    """A primary and one replica, watched by three Sentinels (quorum 2). ``url``:
    ``redis+sentinel://host:s1,host:s2,host:s3/<service>``."""

    DOWN_AFTER_MS, FAILOVER_TIMEOUT_MS = 1000, 3000

    def __init__(self, dir: Path, host: str = "127.0.0.1", maxmemory: str | None = None, service: str = "rkv"):
        super().__init__(dir, host, maxmemory)
        self.service = service
        conf = [*data_conf(maxmemory), f"replica-announce-ip {host}"]
        first = self._node("node", conf)
        second = self._node("node", [*conf, f"replicaof {host} {first.port}"])
        self.nodes = {first.port: first, second.port: second}
        self.sentinels = [self._node("sentinel", [
            "sentinel resolve-hostnames no", f"sentinel announce-ip {host}",
            f"sentinel monitor {service} {host} {first.port} 2",
            f"sentinel down-after-milliseconds {service} {self.DOWN_AFTER_MS}",
            f"sentinel failover-timeout {service} {self.FAILOVER_TIMEOUT_MS}",
        ], sentinel=True) for _ in range(3)]

    @property
    def url(self) -> str:
        return f"redis+sentinel://{','.join(f'{self.host}:{s.port}' for s in self.sentinels)}/{self.service}"

    def start(self) -> None:
        for node in [*self.nodes.values(), *self.sentinels]:
            node.start()
        self._wait(self.whole, "the sentinels agree on a primary and an in-sync replica")

    def primary_port(self) -> int:
        """The primary's port, as the first Sentinel that answers says."""
        for sentinel in self.sentinels:
            try:
                return int(sentinel.client().sentinel_get_master_addr_by_name(self.service)[1])
            except (redis.RedisError, TypeError):  # down, or no answer yet (None)
                continue
        raise RuntimeError("no sentinel names a primary")

    def whole(self) -> bool:
        """Every process up; every sentinel names the same primary, knows the other sentinels (a quorum
        can fail over) and the replica (not down); the replica is in sync and the primary takes writes.

        Not waited for: the sentinels' next look at the replica (every 10 s) reporting its link ``ok``; a
        ``failover`` soon after asks until they accept."""
        primary = self.primary_port()
        replica = next(p for p in self.nodes if p != primary)
        if not all(n.alive for n in [*self.nodes.values(), *self.sentinels]):
            return False
        for sentinel in self.sentinels:
            client = sentinel.client()
            if int(client.sentinel_get_master_addr_by_name(self.service)[1]) != primary:
                return False
            if client.sentinel_master(self.service)["num-other-sentinels"] != len(self.sentinels) - 1:
                return False
            state = {int(r["port"]): r for r in client.sentinel_slaves(self.service)}.get(replica)
            if state is None or state["is_sdown"] or state["is_disconnected"]:
                return False
        return self.nodes[replica].replica_in_sync(primary) and _writable(self.nodes[primary].client())

    def primaries(self) -> list[redis.Redis]:
        return [self.nodes[self.primary_port()].client(timeout=30)]

    def failover(self) -> dict:
        """As an operator plans one: writes paused on the primary (they wait, none is acknowledged there
        after this), ``SENTINEL FAILOVER``, then the old primary made a replica of the new one at once and
        its clients disconnected, as the sentinels would only after their next look at it (~10 s), while
        a client still on it could write there and lose it."""
        old, t0 = self.primary_port(), time.monotonic()
        self.nodes[old].client().execute_command("CLIENT", "PAUSE", 60_000, "WRITE")
        try:
            # NOGOODSLAVE until the sentinels have seen the replica since the last fault: asked again.
            self._wait(lambda: self.sentinels[0].client().sentinel_failover(self.service),
                       "SENTINEL FAILOVER accepted", 60)
            new = self._wait(lambda: self._promoted(old), f"failover: the sentinels promote the replica of {old}")
            demoted = self.nodes[old].client()
            demoted.execute_command("REPLICAOF", self.host, new)
            demoted.execute_command("CONFIG", "REWRITE")
            demoted.execute_command("CLIENT", "KILL", "TYPE", "normal")
        finally:
            self.nodes[old].client().execute_command("CLIENT", "UNPAUSE")
        return self._recover("failover", old, t0)

    def crash(self) -> dict:
        old, t0 = self.primary_port(), time.monotonic()
        self.kill(old)
        return self._recover("crash", old, t0, restart=True)

    def _promoted(self, old: int) -> int | None:
        """The new primary's port once the sentinels name a node other than ``old`` and it takes writes."""
        new = self.primary_port()
        if new != old and self.nodes[new].role() == "master" and _writable(self.nodes[new].client()):
            return new
        return None

    def _recover(self, fault: str, old: int, t0: float, restart: bool = False) -> dict:
        self._wait(lambda: self._promoted(old), f"{fault}: the sentinels promote the replica of {old}")
        writable_s = time.monotonic() - t0
        if restart:  # as from its own config: a master until the sentinels make it a replica
            self.start_node(old)
        self._wait(lambda: self.whole() and self.nodes[old].role() == "slave", f"{fault}: {old} rejoins as a replica")
        return {"fault": fault, "old_primary": old, "new_primary": self.primary_port(),
                "writable_s": round(writable_s, 2), "whole_s": round(time.monotonic() - t0, 2)}

    def kill(self, port: int) -> None:
        """SIGKILL the data node on ``port`` (nothing else: the sentinels carry on)."""
        self.nodes[port].kill()

    def start_node(self, port: int) -> None:
        """Start the data node on ``port`` again, from its folder (config and AOF)."""
        self.nodes[port].start()


class ClusterTopology(Topology):
    """A Redis Cluster: ``masters`` masters with one replica each, every node announcing ``host``.
    ``failover`` and ``crash`` take the shards in turn (shards ordered by their first slot)."""

    NODE_TIMEOUT_MS = 1500

    def __init__(self, dir: Path, host: str = "127.0.0.1", maxmemory: str | None = None, masters: int = 3):
        super().__init__(dir, host, maxmemory)
        for _ in range(2 * masters):
            conf = [*data_conf(maxmemory), "cluster-enabled yes", "cluster-config-file nodes.conf",
                    f"cluster-node-timeout {self.NODE_TIMEOUT_MS}", f"cluster-announce-ip {host}",
                    # the bus on a free port of its own: port + 10000 may be taken, or past 65535
                    f"cluster-port {free_port()}"]
            node = self._node("node", conf)
            self.nodes[node.port] = node
        self.masters = masters
        self.turn = 0

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"{self.host}:{p}" for p in self.nodes)

    def start(self) -> None:
        for node in self.nodes.values():
            node.start()
        subprocess.run(["redis-cli", "--cluster", "create", *(f"{self.host}:{p}" for p in self.nodes),
                        "--cluster-replicas", "1", "--cluster-yes"], check=True, capture_output=True, timeout=60)
        self._wait(self.whole, "the cluster is created, every replica in sync")

    def shards(self, port: int | None = None) -> list[tuple[int, int, int, list[int]]]:
        """(first slot, last slot, master port, replica ports) of each slot range, as the node on ``port``
        (the first live one by default) says."""
        port = port or next(p for p, n in self.nodes.items() if n.alive)
        ranges = self.nodes[port].client().cluster("slots")
        return sorted((int(r[0]), int(r[1]), int(r[2][1]), [int(x[1]) for x in r[3:]]) for r in ranges)

    def _serving(self) -> bool:
        """Every live node says ``cluster_state:ok`` and they all agree on who serves what."""
        live = [p for p, n in self.nodes.items() if n.alive]
        views = [[s[:3] for s in self.shards(p)] for p in live]
        return (all(self.nodes[p].client().cluster("info")["cluster_state"] == "ok" for p in live)
                and all(v == views[0] for v in views) and len(views[0]) == self.masters)

    def whole(self) -> bool:
        """Every node up and serving, each shard with one replica in sync, each master taking writes."""
        if not (all(n.alive for n in self.nodes.values()) and self._serving()):
            return False
        # Written first: CLUSTER SLOTS lists a replica only once it has a replication offset, which a
        # master with nothing to send gives it only at its next replication ping (10 s).
        if not all(_writable(self.nodes[master].client(), _key_in(first, last))
                   for first, last, master, _ in self.shards()):
            return False
        return all(len(reps) == 1 and self.nodes[reps[0]].replica_in_sync(master)
                   for _, _, master, reps in self.shards())

    def primaries(self) -> list[redis.Redis]:
        return [self.nodes[master].client(timeout=30) for _, _, master, _ in self.shards()]

    def _next_shard(self) -> tuple[int, int, int, list[int]]:
        shard = self.shards()[self.turn % self.masters]
        self.turn += 1
        return shard

    def failover(self) -> dict:
        first, last, old, (replica, *_) = self._next_shard()
        t0 = time.monotonic()
        # Refused (ERR) until the replica has caught up enough to take over: asked again until accepted.
        self._wait(lambda: self.nodes[replica].client().cluster("failover"), f"CLUSTER FAILOVER to {replica}")
        return self._recover("failover", (first, last), old, replica, t0)

    def crash(self) -> dict:
        first, last, old, (replica, *_) = self._next_shard()
        t0 = time.monotonic()
        self.nodes[old].kill()
        return self._recover("crash", (first, last), old, replica, t0, restart=True)

    def _recover(self, fault: str, slots: tuple[int, int], old: int, replica: int, t0: float,
                 restart: bool = False) -> dict:
        def promoted():
            return (self._serving() and (slots[0], slots[1], replica) in [s[:3] for s in self.shards()]
                    and _writable(self.nodes[replica].client(), _key_in(*slots)))

        self._wait(promoted, f"{fault}: {replica} serves slots {slots[0]}-{slots[1]} in place of {old}")
        writable_s = time.monotonic() - t0
        if restart:
            self.nodes[old].start()
        self._wait(lambda: self.whole() and self.nodes[old].role() == "slave", f"{fault}: {old} rejoins as a replica")
        return {"fault": fault, "slots": list(slots), "old_primary": old, "new_primary": replica,
                "writable_s": round(writable_s, 2), "whole_s": round(time.monotonic() - t0, 2)}


def _key_in(first: int, last: int) -> str:
    """A probe key whose slot lies in ``first..last``."""
    return next(k for k in (f"{PROBE}-{i}" for i in range(100_000)) if first <= key_slot(k.encode()) <= last)


TOPOLOGIES = {"single": SingleTopology, "sentinel": SentinelTopology, "cluster": ClusterTopology}
