"""Terminal chat client over the server's WebSocket (``rocketkv-mt chat --url ...``).

Replies stream as they are generated; Ctrl-C during a reply cancels it, Ctrl-C or Ctrl-D at the
prompt quits. Commands: ``/session`` (show id and token), ``/resume ID TOKEN``, ``/new``, ``/map`` (where
the session's tokens are: ``api.map_text``), ``/quit``. Each reply ends with a line of its usage and one
of the session's bytes per tier.
With ``RKV_API_KEY`` set in the environment, its (first) key goes in the handshake's
``Authorization: Bearer`` header.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
from urllib.parse import urlsplit, urlunsplit

import httpx
from websockets.asyncio.client import ClientConnection, connect

from api.map_text import render, tier_line

WS_PATH = "/v1/chat/ws"
HELP = "commands: /session, /resume ID TOKEN, /new, /map, /quit; Ctrl-C cancels a reply"


def ws_url(url: str) -> str:
    parts = urlsplit(url if "://" in url else f"http://{url}")
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    path = parts.path if parts.path.endswith(WS_PATH) else parts.path.rstrip("/") + WS_PATH
    return urlunsplit((scheme, parts.netloc, path, "", ""))


def http_url(url: str) -> str:
    """The server's HTTP base URL, from what ``--url`` was given."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
    path = parts.path.removesuffix(WS_PATH).rstrip("/")
    return urlunsplit((scheme, parts.netloc, path, "", ""))


SAMPLING_ARGS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                 "frequency_penalty", "presence_penalty", "seed")


def sampling_args(args: argparse.Namespace) -> dict:
    """The sampling values given on the command line (the rest: the server's defaults)."""
    return {k: getattr(args, k) for k in SAMPLING_ARGS if getattr(args, k, None) is not None}


def _err(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class Client:
    def __init__(self, ws: ClientConnection, args: argparse.Namespace):
        self.ws = ws
        self.args = args
        self.session: dict | None = None

    async def request(self, event: dict) -> dict:
        await self.ws.send(json.dumps(event))
        return json.loads(await self.ws.recv())

    async def bind(self, event: dict) -> None:
        reply = await self.request(event)
        if reply["type"] == "error":
            _err(f"error [{reply['code']}]: {reply['message']}")
            return
        self.session = reply
        _err(f"session {reply['session_id']} (mode {reply['mode']}, replica {reply['replica']}); {HELP}")

    def _message(self, text: str) -> dict:
        return {"type": "message", "content": text, **sampling_args(self.args)}

    async def turn(self, text: str) -> None:
        loop = asyncio.get_running_loop()
        cancel = json.dumps({"type": "cancel"})
        loop.add_signal_handler(signal.SIGINT, lambda: loop.create_task(self.ws.send(cancel)))
        try:
            await self.ws.send(json.dumps(self._message(text)))
            while True:
                event = json.loads(await self.ws.recv())
                if event["type"] == "delta":
                    sys.stdout.write(event["text"])
                    sys.stdout.flush()
                elif event["type"] == "done":
                    u, m = event["usage"], event["memory"]
                    sys.stdout.write("\n")
                    _err(
                        f"  [{u['prefilled_tokens']}/{u['prompt_tokens']} prompt tokens prefilled, "
                        f"{u['generated_tokens']} generated, {event['finish_reason']}; "
                        f"{m['device_bytes'] / 2**20:.1f} MiB on device; replica {event['replica']}]"
                    )
                    _err(tier_line(event))
                    return
                elif event["type"] == "error":
                    _err(f"error [{event['code']}]: {event['message']}")
                    return
        finally:
            loop.remove_signal_handler(signal.SIGINT)

    async def command(self, line: str) -> bool:
        """Run a /command; False means quit."""
        words = line.split()
        if words[0] in ("/quit", "/exit"):
            return False
        if words[0] == "/session" and self.session:
            _err(f"session_id {self.session['session_id']}\ntoken {self.session['token']}")
        elif words[0] == "/resume" and len(words) == 3:
            await self.bind({"type": "session.resume", "session_id": words[1], "token": words[2]})
        elif words[0] == "/new":
            await self.bind(self._create())
        elif words[0] == "/map" and self.session:
            await self.show_map()
        else:
            _err(HELP)
        return True

    async def show_map(self) -> None:
        """Print the session's memory map (``GET /v1/sessions/{id}/memory-map``) as text."""
        url = f"{http_url(self.args.url)}/v1/sessions/{self.session['session_id']}/memory-map"
        headers = {**(auth_headers() or {}), "x-session-token": self.session["token"]}
        try:
            async with httpx.AsyncClient(timeout=30) as http:
                r = await http.get(url, headers=headers)
        except httpx.HTTPError as exc:
            _err(f"cannot reach {url}: {exc}")
            return
        if r.status_code != 200:
            error = r.json().get("error", {}) if r.headers.get("content-type", "").startswith("application/json") else {}
            _err(f"error [{error.get('code', r.status_code)}]: {error.get('message', r.text[:200])}")
            return
        _err(render(r.json(), width=max(16, min(120, shutil.get_terminal_size().columns - 12))))

    def _create(self) -> dict:
        event = {"type": "session.create"}
        if getattr(self.args, "mode", None):
            event["mode"] = self.args.mode
        if getattr(self.args, "budget", None):
            event["budget"] = self.args.budget
        return event

    async def run(self) -> None:
        await self.bind(self._create())
        while True:
            try:
                line = await asyncio.to_thread(input, "> ")
            except EOFError:
                return
            if not line.strip():
                continue
            if line.startswith("/"):
                if not await self.command(line):
                    return
            elif self.session is None:
                _err("no session; /new or /resume ID TOKEN")
            else:
                await self.turn(line)


def auth_headers() -> dict[str, str] | None:
    key = (os.environ.get("RKV_API_KEY") or "").split(",")[0].strip()
    return {"Authorization": f"Bearer {key}"} if key else None


async def _main(args: argparse.Namespace) -> int:
    url = ws_url(args.url)
    try:
        async with connect(url, max_size=None, open_timeout=30, additional_headers=auth_headers()) as ws:
            await Client(ws, args).run()
    except OSError as exc:
        _err(f"cannot reach {url}: {exc}")
        return 1
    return 0


def run_chat_client(args: argparse.Namespace) -> int:
    with contextlib.suppress(KeyboardInterrupt):
        return asyncio.run(_main(args))
    return 0
