"""What ``bench soak`` runs: a Redis topology (``bench.soak_redis``), and chat replicas, each
``rocketkv-mt serve --no-ray`` in a process of its own; with network namespaces on, each replica inside
its own ``bench.soak_net.ReplicaNet`` (its Redis traffic through a proxy the soak can cut or slow), every
Redis process on ``soak_net.REDIS_HOST``.

The fleet keeps the replicas' counters across kills: a killed replica starts again from zero, so its last
``/v1/stats`` is read just before the kill and added to what the run's totals count (``counters``).
"""
from __future__ import annotations

import contextlib
import shlex
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from bench import soak_net
from bench.lifecycle import Lifecycle
from bench.soak_procs import ReplicaProcess
from bench.soak_redis import TOPOLOGIES, Topology

# The replicas' counters a run sums (``GET /v1/stats``): KV restores and rebuilds, saves by durability,
# what the store was found to have lost, Redis round trips.
COUNTER_PREFIXES = ("caches_", "saves_", "store_losses", "divergences", "redis_round_trips")


def counters(stats: dict) -> Counter:
    return Counter({k: int(v) for k, v in stats.items()
                    if k.startswith(COUNTER_PREFIXES) and isinstance(v, (int, float)) and not isinstance(v, bool)})


def netns_choice(wanted: str) -> tuple[bool, str | None]:
    """(namespaces on, why they are off) for ``--netns auto|on|off``; ``on`` where they cannot be made
    is an error."""
    if wanted == "off":
        return False, "--netns off"
    why = soak_net.available()
    if why is not None and wanted == "on":
        raise RuntimeError(f"--netns on: {why}")
    return why is None, why


class NetReplica(ReplicaProcess):
    """A replica inside ``net`` (listening on every address there; reached at ``net.replica_host``), or,
    without one, on loopback as ``ReplicaProcess``."""

    def __init__(self, name: str, env: dict[str, str], log: Path, net: soak_net.ReplicaNet | None = None):
        super().__init__(name, env, log)
        self.net = net

    @property
    def url(self) -> str:
        return f"http://{self.net.replica_host}:{self.port}" if self.net else super().url

    def serve_argv(self) -> list[str]:
        argv = super().argv()
        if self.net is not None:  # clients come in over the namespace's veth, not its loopback
            argv[argv.index("--host") + 1] = "0.0.0.0"
        return argv

    def argv(self) -> list[str]:
        return self.net.wrap(self.serve_argv()) if self.net else self.serve_argv()

    def command(self) -> str:
        """How a user would start it: its ``RKV_`` settings, then ``rocketkv-mt serve ...``."""
        settings = [f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()) if k.startswith("RKV_")]
        return " ".join([*settings, "rocketkv-mt", *self.serve_argv()[3:]])


class LogClock:
    """Copies each replica's log, as it grows, to ``<log>.timed`` with every line stamped with the seconds
    since ``epoch`` (the soak sets it when its clients start, the zero of its events and the clients'
    timelines): the replicas' own lines carry no time. One thread, polling every ``every_s``."""

    def __init__(self, logs: list[Path], every_s: float = 0.1):
        self.logs, self.every_s = list(logs), every_s
        self.epoch = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-log-clock", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        offsets, partial = {log: 0 for log in self.logs}, {log: b"" for log in self.logs}
        while True:
            stopping = self._stop.is_set()
            for log in self.logs:
                with contextlib.suppress(OSError):
                    with open(log, "rb") as f:
                        f.seek(offsets[log])
                        chunk = f.read()
                    offsets[log] += len(chunk)
                    *lines, partial[log] = (partial[log] + chunk).split(b"\n")
                    if lines:
                        stamp = f"{time.monotonic() - self.epoch:9.2f} ".encode()
                        with open(f"{log}.timed", "ab") as out:
                            out.write(b"".join(stamp + line + b"\n" for line in lines))
            if stopping:
                return
            self._stop.wait(self.every_s)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)


class Fleet(Lifecycle):
    """The topology, the namespaces and the replicas of one run, under ``dir``. ``env``: the replicas'
    settings, to which the topology's URL and ``namespace`` are added."""

    def __init__(self, dir: Path, topology: str, replicas: int, env: dict[str, str], namespace: str, netns: bool):
        self.dir, self.namespace, self.netns = Path(dir), namespace, netns
        self.address = soak_net.HostAddress() if netns else None
        self.topology: Topology = TOPOLOGIES[topology](self.dir / "redis",
                                                        host=soak_net.REDIS_HOST if netns else "127.0.0.1")
        env = {**env, "RKV_REDIS_URL": self.topology.url, "RKV_REDIS_NAMESPACE": namespace}
        self.nets = [soak_net.ReplicaNet(i, self.topology.endpoints(), self.dir / "net") if netns else None
                     for i in range(replicas)]
        self.replicas = [NetReplica(f"r{i}", env, self.dir / f"r{i}.log", net) for i, net in enumerate(self.nets)]
        self.retired: Counter = Counter()  # counters of replicas' earlier lives (read before each kill)
        self.clock = LogClock([r.log for r in self.replicas])

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    @property
    def namespaces(self) -> list[soak_net.ReplicaNet]:
        return [net for net in self.nets if net is not None]

    def start(self) -> None:
        if self.netns:
            soak_net.cleanup_stale()  # what soaks that died left would take our addresses
            self.address.start()
        self.topology.start()
        for net in self.namespaces:
            net.start()
        self.clock.start()
        for replica in self.replicas:  # all load their model at once
            replica.spawn()
        for replica in self.replicas:
            replica.wait_healthy()

    def stats(self, replica: ReplicaProcess, timeout: float = 10.0) -> dict | None:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            r = httpx.get(f"{replica.url}/v1/stats", timeout=timeout)
            if r.status_code == 200:
                return r.json()
        return None

    def kill(self, index: int, down_s: float) -> None:
        """SIGKILL replica ``index`` (its counters kept first), and start it again after ``down_s``."""
        replica = self.replicas[index]
        self.retired += counters(self.stats(replica) or {})
        replica.restart(down_s)

    def totals(self) -> tuple[Counter, dict[str, dict]]:
        """Counters summed over every replica and its earlier lives, and each replica's latest stats."""
        latest = {r.name: self.stats(r) or {} for r in self.replicas}
        total = Counter(self.retired)
        for stats in latest.values():
            total += counters(stats)
        return total, latest

    def revive(self) -> None:
        """Every fault undone: namespaces healed, every Redis process and replica up."""
        for net in self.namespaces:
            with contextlib.suppress(Exception):
                net.heal()
        for node in [*self.topology.nodes.values(), *self.topology.sentinels]:
            if not node.alive:
                node.start()
        for replica in self.replicas:
            if replica.proc is None or replica.proc.poll() is not None:
                replica.restart(0)

    def stop_replicas(self) -> float:
        """Stop every replica (SIGTERM); the time they were gone by (their pending KV's clock starts)."""
        for replica in self.replicas:
            with contextlib.suppress(Exception):
                replica.stop()
        return time.monotonic()

    def close(self) -> None:
        self.stop_replicas()
        self.clock.close()
        for net in self.namespaces:
            net.close()
        self.topology.close()
        if self.address is not None:
            self.address.close()
