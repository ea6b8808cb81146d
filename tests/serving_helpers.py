"""Shared pieces of the API tests: a real server on loopback (uvicorn in a thread), small clients."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import uvicorn
from websockets.asyncio.client import connect

REDIS_URL = os.environ.get("RKV_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_available() -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1).ping())
    except Exception:
        return False


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

    from app.serve import build_local_app
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
    port = free_port()
    cmd = [sys.executable, "-m", "app.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1", "RKV_THREADS": "1", **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {proc.stdout.read()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("server did not become healthy")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class WsChat:
    """A WebSocket chat client for tests: send events, collect a turn."""

    def __init__(self, ws):
        self.ws = ws

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, ws_url: str):
        async with connect(ws_url, open_timeout=30, max_size=None) as ws:
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
        """Send a message; return its delta texts and the final ``done`` (or ``error``) event."""
        await self.send({"type": "message", "content": content, "max_tokens": 8, **params})
        deltas = []
        while True:
            event = await self.recv()
            if event["type"] == "delta":
                deltas.append(event["text"])
            else:
                return deltas, event
