"""One ``redis-server`` (or Sentinel) process of a soak's Redis topology: a child of this process, so that
SIGKILL and SIGSTOP reach it directly, its config, AOF and log in a folder of its own.

Data nodes run as production is assumed to: AOF on with ``appendfsync everysec`` and no RDB snapshots
(a SIGKILL loses up to the last second of writes), ``noeviction`` (a full Redis refuses writes, it never
drops sessions), ``maxmemory`` when given.
"""
from __future__ import annotations

import contextlib
import subprocess
import time
from pathlib import Path
from typing import Callable, Iterable

import redis

WAIT_S = 90.0  # a fault under load: sentinel demotes a restarted primary only on its next checks


def data_conf(maxmemory: str | None = None) -> list[str]:
    """The config lines every data node shares. A replica's full sync starts at once (the default waits
    5 s for more replicas to share the transfer; these have one each)."""
    lines = ["appendonly yes", "appendfsync everysec", 'save ""', "maxmemory-policy noeviction",
             "repl-diskless-sync-delay 0"]
    return lines + ([f"maxmemory {maxmemory}"] if maxmemory else [])


def wait_for(ready: Callable[[], object], what: str, timeout: float = WAIT_S, nodes: Iterable["Node"] = ()):
    """Poll ``ready`` (Redis errors count as not yet) until it returns something true, and return that;
    past ``timeout``, a RuntimeError naming ``what`` with the tail of ``nodes``' logs."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(redis.RedisError, OSError):
            value = ready()
            if value:
                return value
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {n.dir.name} (port {n.port}) ---\n{n.log_tail()}" for n in nodes)
            raise RuntimeError(f"{what}: not within {timeout:.0f} s\n{logs}")
        time.sleep(0.05)


class Node:
    """``redis-server`` on ``host:port`` (``sentinel=True``: a Sentinel), its files in ``dir``.

    The config file is written at the first ``start`` only: Redis and Sentinel rewrite it (a replica's
    master, a sentinel's view of the topology), and a restarted node carries on from it, as on a machine
    that came back.
    """

    def __init__(self, dir: Path, host: str, port: int, conf: list[str], sentinel: bool = False):
        self.dir, self.host, self.port, self.sentinel = Path(dir), host, port, sentinel
        self.conf = [f"port {port}", f"bind {host}", f"dir {self.dir}", "protected-mode no", *conf]
        self.proc: subprocess.Popen | None = None

    @property
    def conf_path(self) -> Path:
        return self.dir / ("sentinel.conf" if self.sentinel else "redis.conf")

    @property
    def log(self) -> Path:
        return self.dir / "redis.log"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def client(self, timeout: float = 2.0) -> redis.Redis:
        return redis.Redis(host=self.host, port=self.port, socket_connect_timeout=timeout, socket_timeout=timeout)

    def start(self, timeout: float = WAIT_S) -> None:
        """Start it and return once it answers PING."""
        self.dir.mkdir(parents=True, exist_ok=True)
        if not self.conf_path.exists():
            self.conf_path.write_text("\n".join(self.conf) + "\n")
        argv = ["redis-server", str(self.conf_path), *(["--sentinel"] if self.sentinel else [])]
        with open(self.log, "ab") as out:  # Redis logs to stdout when no logfile is set
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=self.dir)
        wait_for(lambda: self.client(1.0).ping() if self.alive else _exited(self), f"{self} starts", timeout)

    def kill(self) -> None:
        """SIGKILL, as a lost machine: what the AOF had not fsynced is gone."""
        if self.alive:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(timeout=30)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (the AOF is flushed), SIGKILL if it has not exited within ``timeout``."""
        if not self.alive:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def role(self) -> str:
        """``master``, ``slave`` or ``sentinel``, as ROLE says."""
        return self.client().execute_command("ROLE")[0].decode()

    def replica_in_sync(self, master_port: int | None = None) -> bool:
        """A replica whose link to its master is up (of ``master_port`` when given)."""
        info = self.client().info("replication")
        return (info.get("role") == "slave" and info.get("master_link_status") == "up"
                and master_port in (None, int(info.get("master_port", 0))))

    def log_tail(self, chars: int = 800) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def __repr__(self) -> str:
        return f"{'sentinel' if self.sentinel else 'redis'} {self.host}:{self.port}"


def _exited(node: Node) -> bool:
    raise RuntimeError(f"{node} exited with {node.proc.returncode}: {node.log_tail()}")
