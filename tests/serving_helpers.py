"""Shared pieces of the API tests: a real server on loopback (uvicorn in a thread), small clients."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import uvicorn
from websockets.asyncio.client import connect

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deploy_on_a_free_port(settings, deploy, serve, tries: int = 4):
    """``deploy`` with a fresh port each time the proxy loses its port to another process.

    ``free_port`` releases the port before Ray's proxy binds it, and Ray's own start-up opens many
    connections whose local ports come from the same range: now and then one of them takes it.
    """
    for attempt in range(tries):
        try:
            deploy(settings)
            return settings
        except Exception as e:  # the proxy's RuntimeError arrives wrapped in a RayTaskError
            if "Failed to bind" not in str(e) or attempt == tries - 1:
                raise
            serve.shutdown()
            settings = settings.model_copy(update={"port": free_port()})
    raise AssertionError("unreachable")


class ServerThread:
    """uvicorn serving ``app`` on 127.0.0.1 in a background thread, for a ``with`` block."""

    def __init__(self, app):
        self.port = free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/chat/ws"

    @property
    def service(self):
        """The in-process ``ChatService`` behind the app (for checks a client cannot make)."""
        return self.server.config.app.state.service.transport.service

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@contextlib.contextmanager
def local_server(loaded, **overrides):
    import torch

    from api.server import build_local_app
    from app.settings import ServerSettings

    settings = ServerSettings(**{"max_new_tokens": 12, "replica_id": "test-replica", **overrides})
    # One intra-op thread for the server's model thread (it picks the count up at its first op):
    # on a busy 2-core machine, spinning OpenMP threads made turns tens of times slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ServerThread(build_local_app(settings, loaded=loaded)) as server:
            yield server
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def cli_server(*args: str, env: dict | None = None, timeout: float = 120):
    """``rocketkv-mt serve ARGS`` as a subprocess on a free port, stopped (and reaped) afterwards."""
    with server_process(*args, env=env, timeout=timeout) as proc:
        yield proc.url


class ServerProcess:
    def __init__(self, proc: subprocess.Popen, url: str):
        self.proc = proc
        self.url = url
        self.ws_url = url.replace("http", "ws", 1) + "/v1/chat/ws"

    def kill(self) -> None:
        """SIGKILL: the process gets no chance to save or say goodbye, as when a machine dies."""
        self.proc.kill()
        self.proc.wait(timeout=30)


@contextlib.contextmanager
def server_process(*args: str, env: dict | None = None, timeout: float = 120):
    """Like ``cli_server``, yielding a ``ServerProcess`` (url and the process, to kill it)."""
    port = free_port()
    cmd = [sys.executable, "-m", "cli", "serve", "--host", "127.0.0.1", "--port", str(port), *args]
    # A file, not a pipe: nobody reads a pipe while the server runs, and a full one would block it.
    output = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1", "RKV_THREADS": "1", **(env or {})},
                            stdout=output, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                output.seek(0)
                raise RuntimeError(f"server exited: {output.read()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("server did not become healthy")
            time.sleep(0.5)
        yield ServerProcess(proc, url)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        output.close()


class RedisServer:
    """A private ``redis-server`` on a free port (AOF on, in ``dir``), to stop and restart in fault tests;
    ``aof=False``: none, so that it starts from its RDB file alone (a snapshot copied there is its state).

    Never the shared instance: stopping that would break everyone else's tests.
    """

    def __init__(self, dir: str, aof: bool = True, extra: tuple[str, ...] = ()):
        self.dir = str(dir)
        self.port = free_port()
        self.aof = aof
        self.extra = extra  # more redis-server arguments (a managed Redis's renamed CONFIG, say)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self):
        import redis

        return redis.Redis(port=self.port, socket_connect_timeout=1)

    def start(self) -> None:
        subprocess.run(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir,
             *(["--appendonly", "yes", "--appendfsync", "always"] if self.aof else ["--appendonly", "no"]),
             "--save", "", "--daemonize", "yes", *self.extra,
             "--pidfile", os.path.join(self.dir, "redis.pid"), "--logfile", os.path.join(self.dir, "redis.log")],
            check=True,
        )
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(Exception):
                if self.client().ping():
                    return
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        subprocess.run(["redis-cli", "-p", str(self.port), "shutdown", "nosave"], capture_output=True)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:  # a bare connect: redis-py's client retries refused connections with back-off
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
            except OSError:
                return
            time.sleep(0.05)
        raise RuntimeError("redis-server did not stop")

    def __enter__(self) -> "RedisServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        with contextlib.suppress(Exception):
            self.stop()


class BlackHole:
    """An address that accepts connections and never answers a byte: a Redis that hangs (a dead host
    behind a live load balancer, a full network buffer). Connections are held until the block ends."""

    def __init__(self):
        self._server = socket.create_server(("127.0.0.1", 0), backlog=64)
        self._server.settimeout(0.1)
        self._held: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self._server.getsockname()[1]}/0"

    def _accept(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(socket.timeout, OSError):
                self._held.append(self._server.accept()[0])

    def __enter__(self) -> "BlackHole":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for conn in [*self._held, self._server]:
            conn.close()


class WsChat:
    """A WebSocket chat client for tests: send events, collect a turn."""

    def __init__(self, ws):
        self.ws = ws
        self.statuses: list[dict] = []  # the last turn's `status` events (a lost cache rebuilt first)

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, ws_url: str, headers: dict | None = None):
        async with connect(ws_url, open_timeout=30, max_size=None, additional_headers=headers) as ws:
            yield cls(ws)

    async def send(self, event: dict) -> None:
        await self.ws.send(json.dumps(event))

    async def recv(self, timeout: float = 120) -> dict:
        import asyncio

        return json.loads(await asyncio.wait_for(self.ws.recv(), timeout))

    async def create(self, **fields) -> dict:
        await self.send({"type": "session.create", **fields})
        event = await self.recv()
        assert event["type"] == "session", event
        return event

    async def turn(self, content: str, **params) -> tuple[list[str], dict]:
        """Send a message; return its delta texts and the final ``done`` (or ``error``) event; its
        ``status`` events, if any, are kept in ``statuses``."""
        await self.send({"type": "message", "content": content, "max_tokens": 8, **params})
        deltas, self.statuses = [], []
        while True:
            event = await self.recv()
            if event["type"] == "delta":
                deltas.append(event["text"])
            elif event["type"] == "status":
                self.statuses.append(event)
            else:
                return deltas, event


async def turn_until_done(chat: WsChat, content: str, **params) -> tuple[str, dict]:
    """A turn that must succeed: the reply text and its ``done`` event."""
    deltas, done = await chat.turn(content, **params)
    assert done["type"] == "done", done
    return "".join(deltas), done


def session_detail(url: str, info: dict, headers: dict | None = None, timeout: float = 5.0) -> dict:
    """``GET /v1/sessions/{id}`` with the session's token (and ``headers``); it must answer 200."""
    r = httpx.get(f"{url}/v1/sessions/{info['session_id']}", headers={**(headers or {}), "x-session-token": info["token"]},
                  timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]
