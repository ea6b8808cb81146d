"""A TCP proxy whose traffic can be cut or slowed while it runs: how ``bench soak`` partitions one chat
replica from Redis, or makes its Redis slow, while everything else still reaches Redis directly.

``python -m bench.tcp_proxy --listen HOST:PORT=THOST:TPORT ... --control PATH [--netns NAME]`` forwards
each listening address to its target, every connection in both directions, in one asyncio loop. With
``--netns`` the listening sockets are opened inside that network namespace while the connections to the
targets leave from the proxy's own: a replica in the namespace reaches the proxy at the very addresses
Redis has outside it, and Redis need not listen anywhere else.

The control channel is a UNIX socket at PATH, one JSON line in and one out (``ProxyProcess`` speaks it):
``{"op": "cut"}``, ``{"op": "slow", "delay": S}``, ``{"op": "heal"}``, ``{"op": "stats"}``; ``cut`` and
``slow`` take ``"seconds"`` to heal by themselves after that long. Every answer is the counters.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from bench.lifecycle import Lifecycle
from bench.results import ROOT

CLONE_NEWNET = 0x40000000
CHUNK = 65536


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def listen_sockets(addresses: list[tuple[str, int]], netns: str | None) -> list[socket.socket]:
    """Listening sockets for ``addresses``, inside ``netns`` (a name under /run/netns) if given.

    A socket stays in the namespace it was made in, so the calling thread enters it, binds, and goes back.
    """
    if netns is None:
        return [socket.create_server(a, backlog=128) for a in addresses]
    libc = ctypes.CDLL(None, use_errno=True)
    own = os.open(f"/proc/{os.getpid()}/task/{threading.get_native_id()}/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{netns}", os.O_RDONLY)
    try:
        if libc.setns(target, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {netns}")
        try:
            return [socket.create_server(a, backlog=128) for a in addresses]
        finally:
            if libc.setns(own, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back")
    finally:
        os.close(own)
        os.close(target)


@dataclass(eq=False)
class _Conn:
    """One proxied connection. ``dead``: caught by a cut, it forwards nothing ever again and is closed
    at the heal (its stream lost bytes, so it cannot resume)."""
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None
    dead: bool = False

    def close(self) -> None:
        for writer in (self.client, self.upstream):
            if writer is not None:
                writer.close()


class Proxy:
    """The forwarding loop and its mode: ``pass``, ``cut`` (a silent partition: nothing forwarded, no
    FIN or RST, new connections accepted and held mute, so clients run into their own timeouts) or
    ``slow`` (``delay`` seconds before each chunk, both ways)."""

    def __init__(self):
        self.mode, self.delay = "pass", 0.0
        self.conns: set[_Conn] = set()
        self.counts = {"connections": 0, "refused": 0, "cut_connections": 0, "bytes_up": 0, "bytes_down": 0}
        self._timer: asyncio.TimerHandle | None = None

    def stats(self) -> dict:
        return {"mode": self.mode, "delay": self.delay, "open": len(self.conns), **self.counts}

    def command(self, op: str, delay: float = 0.0, seconds: float | None = None) -> dict:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if op == "cut":
            self.mode = "cut"
            for conn in self.conns:
                conn.dead = True
        elif op == "slow":
            self.mode, self.delay = "slow", float(delay)
        elif op == "heal":
            self.mode, self.delay = "pass", 0.0
            for conn in [c for c in self.conns if c.dead]:
                conn.close()
        elif op != "stats":
            raise ValueError(f"unknown op {op!r}")
        if seconds is not None and op in ("cut", "slow"):
            self._timer = asyncio.get_running_loop().call_later(float(seconds), self.command, "heal")
        return self.stats()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, target) -> None:
        conn = _Conn(writer, dead=self.mode == "cut")
        self.counts["connections"] += 1
        self.conns.add(conn)
        try:
            if conn.dead:
                await self._pump(reader, None, conn, "bytes_up")
                return
            try:
                up_reader, conn.upstream = await asyncio.wait_for(asyncio.open_connection(*target), 5)
            except (OSError, asyncio.TimeoutError):
                # The target is down: an RST, as the client would get from a closed port.
                self.counts["refused"] += 1
                sock = writer.get_extra_info("socket")
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.transport.abort()
                return
            await asyncio.gather(self._pump(reader, conn.upstream, conn, "bytes_up"),
                                 self._pump(up_reader, writer, conn, "bytes_down"))
        finally:
            if conn.dead:
                self.counts["cut_connections"] += 1
            self.conns.discard(conn)
            conn.close()

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter | None, conn: _Conn,
                    counter: str) -> None:
        """Copy ``src`` to ``dst`` until either side ends; a dead connection's bytes are read and dropped
        (a partition loses them) until the heal closes it."""
        try:
            while data := await src.read(CHUNK):
                if self.mode == "slow" and not conn.dead:
                    await asyncio.sleep(self.delay)
                if conn.dead or dst is None:
                    continue
                dst.write(data)
                await dst.drain()
                self.counts[counter] += len(data)
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            conn.close()  # one side gone: the other goes too, as with a direct connection

    async def control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while line := await reader.readline():
                try:
                    answer = self.command(**json.loads(line))
                except (ValueError, TypeError) as exc:
                    answer = {"error": str(exc)}
                writer.write(json.dumps(answer).encode() + b"\n")
                await writer.drain()
        writer.close()


async def serve(routes: list[tuple[socket.socket, tuple[str, int]]], control: str, watch_stdin: bool) -> None:
    proxy = Proxy()
    for sock, target in routes:
        await asyncio.start_server(lambda r, w, t=target: proxy.handle(r, w, t), sock=sock)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(control)
    await asyncio.start_unix_server(proxy.control, path=control)
    print("ready", flush=True)
    if watch_stdin:  # stdin closes when the parent dies: a proxy never outlives its soak
        await asyncio.to_thread(sys.stdin.buffer.read)
    else:
        await asyncio.Event().wait()


class ProxyProcess(Lifecycle):
    """``bench.tcp_proxy`` as a child of this process, and its controls. ``routes``: (listen host, port,
    target host, port). It exits when this process does (its stdin is a pipe from here)."""

    def __init__(self, routes: list[tuple[str, int, str, int]], control: Path, log: Path, netns: str | None = None):
        self.routes, self.control_path, self.log, self.netns = routes, Path(control), Path(log), netns
        self.proc: subprocess.Popen | None = None

    def argv(self) -> list[str]:
        listen = [f"{h}:{p}={th}:{tp}" for h, p, th, tp in self.routes]
        return [sys.executable, "-m", "bench.tcp_proxy", "--control", str(self.control_path), "--watch-stdin",
                *(["--netns", self.netns] if self.netns else []), "--listen", *listen]

    def start(self, timeout: float = 20.0) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.argv(), stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
                                         cwd=ROOT)
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError):
                self.stats()
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"tcp proxy did not start: {self.log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.05)

    def send(self, op: str, **args) -> dict:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect(str(self.control_path))
            s.sendall(json.dumps({"op": op, **args}).encode() + b"\n")
            answer = json.loads(s.makefile("rb").readline())
        if "error" in answer:
            raise ValueError(answer["error"])
        return answer

    def cut(self, seconds: float | None = None) -> dict:
        return self.send("cut", seconds=seconds)

    def slow(self, delay_s: float, seconds: float | None = None) -> dict:
        return self.send("slow", delay=delay_s, seconds=seconds)

    def heal(self) -> dict:
        return self.send("heal")

    def stats(self) -> dict:
        return self.send("stats")

    def close(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.tcp_proxy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", nargs="+", required=True, metavar="HOST:PORT=THOST:TPORT")
    parser.add_argument("--control", required=True, help="the control channel's UNIX socket path")
    parser.add_argument("--netns", help="open the listening sockets in this network namespace (/run/netns)")
    parser.add_argument("--watch-stdin", action="store_true", help="exit when stdin closes")
    args = parser.parse_args(argv)
    pairs = [tuple(_address(side) for side in spec.split("=", 1)) for spec in args.listen]
    socks = listen_sockets([listen for listen, _ in pairs], args.netns)
    asyncio.run(serve(list(zip(socks, [target for _, target in pairs])), args.control, args.watch_stdin))


if __name__ == "__main__":
    main()
