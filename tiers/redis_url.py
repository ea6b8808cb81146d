"""What ``RKV_REDIS_URL`` names: one Redis (``redis://``, ``rediss://``, ``unix://``, as redis-py reads
them) or a Redis Cluster, ``redis+cluster://[user:password@]host:port[,host:port...]`` (``rediss+cluster``
for TLS): the nodes a client asks first for the cluster's layout; any one that answers is enough.

Parsing only, no client: the settings check a URL with it at startup, before anything connects.
"""
from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")


@dataclass(frozen=True)
class ClusterUrl:
    nodes: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = None
    ssl: bool = False


def is_cluster(url: str) -> bool:
    return url.partition("://")[0].lower() in CLUSTER_SCHEMES


def parse_cluster(url: str) -> ClusterUrl:
    """The startup nodes and credentials of a cluster URL; ``ValueError`` saying what is wrong."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in CLUSTER_SCHEMES:
        raise ValueError(f"not a Redis Cluster URL ({'|'.join(CLUSTER_SCHEMES)}://host:port,...): {url!r}")
    if any(c in rest for c in "/?#"):
        # A cluster has one database and no per-URL options here; a path or query would be ignored silently.
        raise ValueError(f"a Redis Cluster URL is host:port[,host:port...] with nothing after: {url!r}")
    auth, _, hosts = rest.rpartition("@")
    username = password = None
    if auth:
        user, colon, secret = auth.partition(":")
        username, password = (unquote(user) or None), (unquote(secret) if colon else None)
    nodes = []
    for item in hosts.split(","):
        host, colon, port = item.strip().rpartition(":")
        host = host.strip("[]")  # an IPv6 address in brackets
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"a Redis Cluster node must be host:port, not {item!r} (in {url!r})")
        nodes.append((host, int(port)))
    return ClusterUrl(tuple(nodes), username, password, scheme.lower().startswith("rediss"))
