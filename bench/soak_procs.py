"""The processes of ``bench soak``: a private ``redis-server`` with AOF on, and chat replicas, each
``rocketkv-mt serve --no-ray`` in a process of its own on a loopback port, started, killed (SIGKILL,
as when a machine dies) and started again on the same port.

Standard library and ``httpx`` only: nothing here loads a model; the replicas do.
"""
from __future__ import annotations

import contextlib
import os
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.results import ROOT

HEALTH_TIMEOUT_S = 180.0  # a replica's start: the model loaded (converted once per machine before)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


class RedisProcess:
    """``redis-server`` on a free loopback port, AOF on in ``dir``, a child of this process.

    ``stop`` is a ``SHUTDOWN`` (the AOF is flushed first); ``start`` again on the same port and dir
    loads it back, as a Redis restarted by its operator would.
    """

    def __init__(self, dir: Path, binary: str = "redis-server"):
        self.dir = Path(dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.binary = binary
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self, timeout: float = 5.0):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=timeout, socket_timeout=timeout)

    def start(self, timeout: float = 30.0) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
             "--appendonly", "yes", "--save", "", "--logfile", str(self.dir / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(Exception):
                if self.client(1.0).ping():
                    return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start: {_tail(self.dir / 'redis.log')}")
            time.sleep(0.05)

    def stop(self, timeout: float = 60.0) -> None:
        """``SHUTDOWN`` (AOF flushed), then wait for the process to end; SIGKILL only if it will not."""
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(Exception):  # the connection drops as it shuts down
            self.client().shutdown()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def restart(self, down_s: float) -> None:
        self.stop()
        time.sleep(down_s)
        self.start()


class ReplicaProcess:
    """One chat replica: ``python -m cli serve --no-ray`` on its own port, with ``env`` over this
    process's environment, its output appended to ``log``. The code is this checkout's (``ROOT`` first
    on the path), whatever copy of the package the interpreter has installed."""

    def __init__(self, name: str, env: dict[str, str], log: Path):
        self.name = name
        self.port = free_port()
        self.env = {**env, "RKV_REPLICA_ID": name}
        self.log = Path(log)
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "cli", "serve", "--no-ray", "--host", "127.0.0.1", "--port", str(self.port)]

    def command(self) -> str:
        """How a user would start it: its ``RKV_`` settings, then ``rocketkv-mt serve ...``."""
        settings = [f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()) if k.startswith("RKV_")]
        return " ".join([*settings, "rocketkv-mt", *self.argv()[3:]])

    def spawn(self) -> None:
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **self.env, "PYTHONPATH": path}
        with open(self.log, "a") as out:  # the child keeps its own copy of the descriptor
            out.write(f"--- start {self.starts + 1} ---\n")
            out.flush()
            self.proc = subprocess.Popen(self.argv(), env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        self.starts += 1

    def wait_healthy(self, timeout: float = HEALTH_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"replica {self.name} exited: {_tail(self.log)}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"replica {self.name} did not become healthy: {_tail(self.log)}")
            time.sleep(0.25)

    def kill(self) -> None:
        """SIGKILL: no save, no goodbye."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()

    def restart(self, down_s: float) -> None:
        self.kill()
        time.sleep(down_s)
        self.spawn()
        self.wait_healthy()


class Cluster:
    """The private Redis and the replicas of one soak run, under ``dir``; a ``with`` block stops them all."""

    def __init__(self, dir: Path, replicas: int, env: dict[str, str], namespace: str = "rkv"):
        self.dir = Path(dir)
        self.namespace = namespace
        self.redis = RedisProcess(self.dir / "redis")
        env = {**env, "RKV_REDIS_URL": self.redis.url, "RKV_REDIS_NAMESPACE": namespace}
        self.replicas = [ReplicaProcess(f"r{i}", env, self.dir / f"r{i}.log") for i in range(replicas)]

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    def start(self) -> None:
        self.redis.start()
        for replica in self.replicas:  # all load their model at once
            replica.spawn()
        for replica in self.replicas:
            replica.wait_healthy()

    def close(self) -> None:
        for replica in self.replicas:
            with contextlib.suppress(Exception):
                replica.stop()
        with contextlib.suppress(Exception):
            self.redis.stop()

    def __enter__(self) -> "Cluster":
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()
