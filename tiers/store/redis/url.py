"""What ``RKV_REDIS_URL`` names: one Redis (``redis://``, ``rediss://``, ``unix://``, as redis-py reads
them); a Redis Cluster, ``redis+cluster://[user:password@]host:port[,host:port...]`` (the nodes a client
asks first for the cluster's layout; any one that answers is enough); or the primary of a Redis Sentinel
set, ``redis+sentinel://[user:password@]host:port[,host:port...]/<service>[/<db>]`` (the sentinels, and
the name they monitor the primary under: the form Kubernetes charts give). ``rediss+…`` for TLS; a
sentinel URL's credentials and TLS are the primary's and the sentinels' alike (as charts set them). Parsing
only, no client: the settings check a URL with it at startup, before anything connects.
"""
from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")


@dataclass(frozen=True)
class ClusterUrl:
    nodes: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = None
    ssl: bool = False


@dataclass(frozen=True)
class SentinelUrl(ClusterUrl):
    service: str = ""
    db: int = 0


def _scheme(url: str) -> str:
    return url.partition("://")[0].lower()


def is_cluster(url: str) -> bool:
    return _scheme(url) in CLUSTER_SCHEMES


def is_sentinel(url: str) -> bool:
    return _scheme(url) in SENTINEL_SCHEMES


def _nodes(url: str, rest: str) -> tuple[tuple[tuple[str, int], ...], str | None, str | None]:
    """The host:port list of ``rest`` (after the scheme, before any path) and its credentials."""
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
            raise ValueError(f"a Redis node must be host:port, not {item!r} (in {url!r})")
        nodes.append((host, int(port)))
    return tuple(nodes), username, password


def parse_cluster(url: str) -> ClusterUrl:
    """The startup nodes and credentials of a cluster URL; ``ValueError`` saying what is wrong."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in CLUSTER_SCHEMES:
        raise ValueError(f"not a Redis Cluster URL ({'|'.join(CLUSTER_SCHEMES)}://host:port,...): {url!r}")
    if any(c in rest for c in "/?#"):
        # A cluster has one database and no per-URL options here; a path or query would be ignored silently.
        raise ValueError(f"a Redis Cluster URL is host:port[,host:port...] with nothing after: {url!r}")
    nodes, username, password = _nodes(url, rest)
    return ClusterUrl(nodes, username, password, scheme.lower().startswith("rediss"))


def parse_sentinel(url: str) -> SentinelUrl:
    """The sentinels, service, database and credentials of a sentinel URL; ``ValueError`` saying what is wrong."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in SENTINEL_SCHEMES:
        raise ValueError(f"not a Redis Sentinel URL ({'|'.join(SENTINEL_SCHEMES)}://host:port,.../service): {url!r}")
    hosts, slash, path = rest.partition("/")
    parts = path.split("/") if slash else []
    if any(c in path for c in "?#") or not 1 <= len(parts) <= 2 or not parts[0] or \
            (len(parts) == 2 and not parts[1].isdigit()):
        raise ValueError(f"a Redis Sentinel URL is host:port[,host:port...]/<service>[/<db>]: {url!r}")
    nodes, username, password = _nodes(url, hosts)
    return SentinelUrl(nodes, username, password, scheme.lower().startswith("rediss"), unquote(parts[0]),
                       int(parts[1]) if len(parts) == 2 else 0)
