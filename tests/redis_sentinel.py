"""A private Redis Sentinel deployment on loopback for the sentinel tests: a primary, one replica and three
sentinels (quorum 2, ``down-after-milliseconds`` 1000, ``failover-timeout`` 3000) on free 127.0.0.1
ports, in a temp dir. The soak's ``SentinelTopology`` (bench/soak_redis.py) runs it; this adds the view a
test needs: which node is primary, a planned failover, a primary killed (SIGKILL: a lost machine) and
started again.

``url`` is the service's ``redis+sentinel://127.0.0.1:s1,127.0.0.1:s2,127.0.0.1:s3/<name>``. A ``with``
block starts and stops it; ``missing_reason()`` says why it cannot start here (the tools a local cluster
needs: ``redis-server`` runs Sentinel too), for a ``skipif``.
"""
from __future__ import annotations

from pathlib import Path

from redis_cluster import missing_reason

from bench.lifecycle import Lifecycle
from bench.soak_redis import SentinelTopology

__all__ = ["RedisSentinel", "missing_reason"]


class RedisSentinel(Lifecycle):
    def __init__(self, dir, name: str = "rkv"):
        self.topology = SentinelTopology(Path(dir), host="127.0.0.1", service=name)
        self.name = name

    @property
    def url(self) -> str:
        return self.topology.url

    @property
    def ports(self) -> list[int]:
        """The data nodes' ports (primary and replica, in no particular order)."""
        return list(self.topology.nodes)

    def primary_port(self) -> int:
        """The primary's port, as a sentinel says (``SENTINEL get-master-addr-by-name``)."""
        return self.topology.primary_port()

    def client(self, port: int | None = None):
        """A plain client of the current primary (or of the node on ``port``)."""
        return self.topology.nodes[port or self.primary_port()].client(timeout=5)

    def failover(self) -> int:
        """``SENTINEL FAILOVER``; returns the new primary's port once a sentinel names it, it answers ROLE
        as master and takes a write (and the old primary follows it as a replica)."""
        return self.topology.failover()["new_primary"]

    def kill_primary(self) -> int:
        """SIGKILL the primary; returns its port. The sentinels promote the replica within seconds."""
        port = self.primary_port()
        self.topology.kill(port)
        return port

    def start_node(self, port: int) -> None:
        """Start the node on ``port`` again from its folder; the sentinels make it a replica if another
        node is primary by then."""
        self.topology.start_node(port)

    def start(self) -> None:
        """Start the nodes and sentinels; return once the sentinels agree and the replica is in sync."""
        self.topology.start()

    def close(self) -> None:
        self.topology.close()

