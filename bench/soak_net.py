"""Isolating one chat replica's Redis traffic for ``bench soak``: cut it off from Redis, or make its Redis
slow, while the soak's HTTP clients still reach it, and nothing else's Redis traffic changes. Needs root
and iproute2 (``ip netns``); no packet filter or traffic shaper.

The addresses:

- Redis (every node and sentinel of the topology) listens on ``REDIS_HOST`` (10.77.0.1), a /32 that
  ``HostAddress`` puts on the root namespace's ``lo``: the soak's own processes reach Redis there directly.
- Replica ``i`` runs in a network namespace ``rkvsoak<i>-<owner pid>-<token>`` joined to the root one by
  a veth pair: 10.88.<i>.1/30 on the root side, 10.88.<i>.2/30 (``replica_host``, where HTTP clients reach
  the replica) inside. The namespace's ``lo`` carries 10.77.0.1/32 too, so every Redis address the replica
  connects to, including those the sentinels or the cluster hand out, lands on its own loopback.
- There a ``bench.tcp_proxy`` listens on 10.77.0.1:<port> for every endpoint. The proxy process itself
  lives in the root namespace (only its listening sockets were made inside), so it forwards to the real
  10.77.0.1:<port>: Redis needs no other address, and cutting the proxy partitions that replica alone.

The proxy's stdin is a pipe from this process, so it exits with the soak; ``cleanup_stale`` removes the
namespaces (and the processes in them) of soaks that died before their ``close``.
"""
from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path

from bench.lifecycle import Lifecycle
from bench.tcp_proxy import ProxyProcess

REDIS_HOST = "10.77.0.1"
PREFIX = "rkvsoak"
_VETH = re.compile(r"^\d+: (rkv[0-9a-f]{6}h)@\S+:.*?(?:link-netns (\S+))?$")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=30)


def available() -> str | None:
    """Why replicas cannot be isolated here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed"
    if not Path("/proc/self/ns/net").exists():
        return "this kernel has no network namespaces"
    listing = _ip("netns", "list", check=False)
    return None if listing.returncode == 0 else f"ip netns does not work: {listing.stderr.strip()}"


def _has_address(address: str, netns: str | None = None) -> bool:
    shown = _ip(*(["-n", netns] if netns else []), "-o", "-4", "addr", "show", check=False).stdout
    return f" {address}/" in shown


class HostAddress(Lifecycle):
    """``address``/32 on the root namespace's ``lo``, where the soak's Redis listens. ``close`` removes
    it only if ``start`` added it (an earlier run may have left it; it harms nothing)."""

    def __init__(self, address: str = REDIS_HOST):
        self.address = address
        self.added = False

    def start(self) -> None:
        if not _has_address(self.address):
            _ip("addr", "add", f"{self.address}/32", "dev", "lo")
            self.added = True

    def close(self) -> None:
        if self.added:
            _ip("addr", "del", f"{self.address}/32", "dev", "lo", check=False)
            self.added = False


class ReplicaNet(Lifecycle):
    """Replica ``index``'s namespace, veth pair and Redis proxy (see the module's docstring).

    ``endpoints``: every (host, port) of Redis the replica may connect to (``Topology.endpoints()``); the
    proxy listens for each at the same address inside the namespace. ``dir``: the proxy's control socket
    and log. ``start`` builds it all, ``close`` removes it all (also after a failed ``start``).
    """

    def __init__(self, index: int, endpoints: list[tuple[str, int]], dir: Path):
        if not 0 <= index <= 255:
            raise ValueError(f"a replica index is 0..255, not {index}")
        self.index, self.endpoints, self.dir = index, list(endpoints), Path(dir)
        token = secrets.token_hex(3)
        self.netns = f"{PREFIX}{index}-{os.getpid()}-{token}"
        self.veth_host, self.veth_ns = f"rkv{token}h", f"rkv{token}n"
        self.host_side = f"10.88.{index}.1"
        self.replica_host = f"10.88.{index}.2"
        self.proxy = ProxyProcess([(h, p, h, p) for h, p in self.endpoints], self.dir / f"proxy{index}.sock",
                                  self.dir / f"proxy{index}.log", netns=self.netns)

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        if _has_address(self.host_side):
            raise RuntimeError(f"{self.host_side} is in use: another soak runs, or call cleanup_stale()")
        try:
            _ip("netns", "add", self.netns)
            _ip("link", "add", self.veth_host, "type", "veth", "peer", "name", self.veth_ns, "netns", self.netns)
            _ip("addr", "add", f"{self.host_side}/30", "dev", self.veth_host)
            _ip("link", "set", self.veth_host, "up")
            inside = ("-n", self.netns)
            _ip(*inside, "link", "set", "lo", "up")
            _ip(*inside, "addr", "add", f"{self.replica_host}/30", "dev", self.veth_ns)
            _ip(*inside, "link", "set", self.veth_ns, "up")
            for host in sorted({h for h, _ in self.endpoints}):
                if not ipaddress.ip_address(host).is_loopback:  # 127.0.0.0/8 is on every lo already
                    _ip(*inside, "addr", "add", f"{host}/32", "dev", "lo")
            self.proxy.start()
        except BaseException:
            self.close()
            raise

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` run inside the namespace. ``ip netns exec`` execs it (no fork), so the process it
        starts keeps its PID: signals to ``Popen.pid`` reach the program itself."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def cut(self, seconds: float | None = None) -> dict:
        """A silent partition from Redis, until ``heal`` (or for ``seconds``, healed by the proxy itself):
        open connections go mute (no FIN, no RST), new ones are accepted and held mute; at the heal the
        connections caught by it are closed, new ones forward again. Returns the proxy's counters."""
        return self.proxy.cut(seconds)

    def slow(self, delay_s: float, seconds: float | None = None) -> dict:
        """``delay_s`` more before every chunk forwarded either way, until ``heal`` (or ``seconds``)."""
        return self.proxy.slow(delay_s, seconds)

    def heal(self) -> dict:
        return self.proxy.heal()

    def stats(self) -> dict:
        """Connections and bytes through the proxy, and its mode: for the soak's report."""
        return self.proxy.stats()

    def close(self) -> None:
        """The proxy first (its sockets would keep the namespace alive), any process left inside, then
        the namespace; deleting the root end of the veth removes both ends and the root-side address."""
        with contextlib.suppress(Exception):
            self.proxy.close()
        _remove_namespace(self.netns)
        _ip("link", "del", self.veth_host, check=False)


def _remove_namespace(netns: str) -> None:
    for pid in _ip("netns", "pids", netns, check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    _ip("netns", "del", netns, check=False)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale() -> list[str]:
    """Remove what soaks that died left behind: ``rkvsoak*`` namespaces whose owner process is gone (and
    the processes in them), and soak veths whose namespace is not a live soak's. Returns what it removed."""
    live, removed = set(), []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        match = re.fullmatch(rf"{PREFIX}\d+-(\d+)-[0-9a-f]+", name)
        if not match:
            continue
        if _alive(int(match.group(1))):
            live.add(name)
        else:
            _remove_namespace(name)
            removed.append(name)
    for line in _ip("-o", "link", "show", "type", "veth", check=False).stdout.splitlines():
        match = _VETH.match(line.strip())
        if match and match.group(2) not in live:
            _ip("link", "del", match.group(1), check=False)
            removed.append(match.group(1))
    return removed


def pause(pid: int, seconds: float) -> None:
    """SIGSTOP ``pid`` for ``seconds`` (a replica frozen: a long GC pause, a VM stall), then SIGCONT, also
    when interrupted. Blocks: run it in a thread from async code."""
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
