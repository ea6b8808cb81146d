"""The chat replicas of ``bench soak``, each ``rocketkv-mt serve --no-ray`` in a process of its own on a
loopback port, started, killed (SIGKILL, as when a machine dies) and started again on the same port
(``bench.soak_fleet`` runs them in network namespaces; ``bench.soak_redis`` runs their Redis).

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
