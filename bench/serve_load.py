"""``rocketkv-mt bench serve``: load test of a running server over its WebSocket chat protocol.

Each of S sessions first sends a message of about N tokens of filler (its context), then K short
turns; every turn asks for ``--max-tokens`` tokens, greedy. Two phases in one run, with the same
conversations (so greedy replies, and the tokens generated, are the same in both):

1. concurrent: the S sessions load their context at once; when all have (a barrier), they take
   their K short turns at once. This is what the server's continuous batching serves.
2. sequential: the same S conversations on new sessions, one session at a time.

``aggregate_tokens_per_s`` and ``sequential_tokens_per_s`` are tokens generated in the short turns
divided by the wall time of those turns (the sequential figure adds up the short-turn time of each
session alone); ``speedup`` is their ratio. ``with_context`` gives the same over the whole phase,
context messages included. Latency and time to first token (client side: from sending the message
to its ``done`` / first ``delta``) are over the short turns of the concurrent phase. Peak device
bytes and the device budget come from the server's ``GET /v1/stats``. On a terminal a bar counts the
turns of both phases, with the phase's throughput so far (``--quiet``: none).
"""
from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field

import httpx
from websockets.asyncio.client import connect

from api.client import ws_url
from app.progress import progress
from bench.common import GREEDY, write_json
from bench.haystack import filler_text

SHORT_TURNS = [
    "Now tell a short story about the river and the mill, in at least five sentences.",
    "Continue the story: what happens the next morning at the market?",
    "Describe the valley in the evening, with many details.",
    "Write a poem of eight lines about the road that bends north.",
    "Explain, step by step, how the old mill works.",
    "Tell what the clouds over the hills look like during a storm.",
]
CONTEXT_QUESTION = "\n\nRead the text above. Then describe the landscape it paints, in several sentences."


@dataclass
class Turn:
    kind: str  # "context" or "short"
    start: float = 0.0
    first: float | None = None
    end: float = 0.0
    generated: int = 0
    error: str | None = None
    code: str | None = None  # the error's code (``device_memory_exhausted``, ...)
    replica: str | None = None  # the replica that answered ``done``
    server_ttft_ms: float | None = None

    @property
    def ttft_ms(self) -> float:
        return ((self.first if self.first is not None else self.end) - self.start) * 1000

    @property
    def latency_ms(self) -> float:
        return (self.end - self.start) * 1000


@dataclass
class Conversation:
    index: int
    context_text: str
    short_texts: list[str]
    turns: list[Turn] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def context_text(n_tokens: int, seed: int) -> str:
    """About n_tokens tokens of filler (the bundled tokenizer gives ~1.3 tokens a word on it)."""
    return filler_text(int(n_tokens / 1.3), seed) + CONTEXT_QUESTION


def conversations(args) -> list[Conversation]:
    return [
        Conversation(i, context_text(args.context, seed=100 + i),
                     [SHORT_TURNS[(i + k) % len(SHORT_TURNS)] for k in range(args.turns)])
        for i in range(args.sessions)
    ]


class Session:
    def __init__(self, ws, args):
        self.ws = ws
        self.args = args
        self.info: dict = {}  # the server's ``session`` event: id, token, replica

    async def recv(self, timeout: float = 1800) -> dict:
        return json.loads(await asyncio.wait_for(self.ws.recv(), timeout))

    async def create(self) -> str:
        event = {"type": "session.create"}
        if self.args.mode:
            event["mode"] = self.args.mode
        if self.args.budget:
            event["budget"] = self.args.budget
        await self.ws.send(json.dumps(event))
        while True:
            reply = await self.recv()
            if reply["type"] == "session":
                self.info = reply
                return reply["session_id"]
            if reply["type"] == "error":
                raise RuntimeError(f"{reply.get('code')}: {reply.get('message')}")

    async def turn(self, text: str, kind: str) -> Turn:
        turn = Turn(kind)
        message = {"type": "message", "content": text, "max_tokens": self.args.max_tokens, **GREEDY}
        turn.start = time.perf_counter()
        await self.ws.send(json.dumps(message))
        while True:
            event = await self.recv()
            if event["type"] == "delta":
                if turn.first is None:
                    turn.first = time.perf_counter()
            elif event["type"] == "done":
                turn.end = time.perf_counter()
                turn.generated = int(event["usage"]["generated_tokens"])
                turn.server_ttft_ms = event.get("ttft_ms")
                turn.replica = event.get("replica")
                return turn
            elif event["type"] == "error":
                turn.end = time.perf_counter()
                turn.code = event.get("code")
                turn.error = f"{turn.code}: {event.get('message')}"
                return turn


def open_session(url: str, args):
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    return connect(ws_url(url), open_timeout=60, max_size=None, additional_headers=headers, ping_interval=None)


class Barrier:
    """Wait until ``parties`` have arrived (asyncio.Barrier needs Python 3.11)."""

    def __init__(self, parties: int):
        self.left = parties
        self.event = asyncio.Event()

    async def wait(self) -> None:
        self.left -= 1
        if self.left <= 0:
            self.event.set()
        await self.event.wait()


async def run_conversation(url: str, args, conv: Conversation, barrier: Barrier | None, on_turn=None) -> None:
    """Context message, (wait for the others,) then the short turns; errors are recorded, not raised.
    ``on_turn(turn)`` after each turn."""
    passed_barrier = False
    try:
        async with open_session(url, args) as ws:
            session = Session(ws, args)
            await session.create()
            conv.turns.append(await session.turn(conv.context_text, "context"))
            if on_turn is not None:
                on_turn(conv.turns[-1])
            if barrier is not None:
                passed_barrier = True
                await barrier.wait()
            for text in conv.short_texts:
                conv.turns.append(await session.turn(text, "short"))
                if on_turn is not None:
                    on_turn(conv.turns[-1])
    except Exception as exc:  # noqa: BLE001 - a load test reports failures
        conv.errors.append(f"{type(exc).__name__}: {exc}")
        if barrier is not None and not passed_barrier:
            await barrier.wait()  # do not leave the others waiting


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return round(values[lo] + (values[hi] - values[lo]) * (k - lo), 1)


def summary(convs: list[Conversation], kind: str) -> dict:
    turns = [t for c in convs for t in c.turns if t.kind == kind and t.error is None]
    lat, ttft = [t.latency_ms for t in turns], [t.ttft_ms for t in turns]
    return {
        "turns": len(turns),
        "generated_tokens": sum(t.generated for t in turns),
        "latency_ms": {"p50": pct(lat, 0.5), "p95": pct(lat, 0.95), "mean": round(statistics.mean(lat), 1) if lat else None},
        "ttft_ms": {"p50": pct(ttft, 0.5), "p95": pct(ttft, 0.95)},
    }


def errors_of(convs: list[Conversation]) -> list[str]:
    return [e for c in convs for e in c.errors] + [t.error for c in convs for t in c.turns if t.error]


async def server_stats(url: str, args) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as client:
        r = await client.get("/v1/stats")
        if r.status_code == 200:
            return r.json()
        return {"error": f"/v1/stats answered {r.status_code}"}


class Tally:
    """The run's progress bar, advanced by each finished turn, with the phase's tokens per second."""

    def __init__(self, bar):
        self.bar = bar
        self.phase, self.t0, self.tokens = "", time.perf_counter(), 0

    def start(self, phase: str) -> None:
        self.phase, self.t0, self.tokens = phase, time.perf_counter(), 0

    def __call__(self, turn: Turn) -> None:
        self.tokens += turn.generated
        rate = self.tokens / max(time.perf_counter() - self.t0, 1e-9)
        self.bar.set_postfix_str(f"{self.phase}: {rate:.1f} tokens/s")
        self.bar.update()


async def concurrent_phase(url: str, args, convs: list[Conversation], on_turn=None) -> dict:
    barrier = Barrier(len(convs) + 1)
    t0 = time.perf_counter()
    tasks = [asyncio.create_task(run_conversation(url, args, c, barrier, on_turn)) for c in convs]
    await barrier.wait()  # every session has its context
    t1 = time.perf_counter()
    await asyncio.gather(*tasks)
    t2 = time.perf_counter()
    return {"context_s": t1 - t0, "short_s": t2 - t1, "total_s": t2 - t0}


async def sequential_phase(url: str, args, convs: list[Conversation], on_turn=None) -> dict:
    context_s = short_s = 0.0
    for conv in convs:
        t0 = time.perf_counter()
        await run_conversation(url, args, conv, None, on_turn)
        total = time.perf_counter() - t0
        ctx = sum(t.latency_ms for t in conv.turns if t.kind == "context") / 1000
        context_s += ctx
        short_s += total - ctx
    return {"context_s": context_s, "short_s": short_s, "total_s": context_s + short_s}


async def run(args) -> dict:
    url = args.url.rstrip("/")
    before = await server_stats(url, args)
    result: dict = {
        "url": url,
        "sessions": args.sessions,
        "turns": args.turns,
        "context": args.context,
        "max_tokens": args.max_tokens,
        "mode": args.mode or "server default",
        "measured": "short turns after each session's context message; tokens/s = generated tokens / wall time",
    }
    phases = 1 if args.no_sequential else 2
    with progress(phases * args.sessions * (1 + args.turns), "bench serve", quiet=args.quiet, unit="turn") as bar:
        return await _phases(url, args, result, before, Tally(bar))


async def _phases(url: str, args, result: dict, before: dict, tally: Tally) -> dict:
    conc = conversations(args)
    tally.start("concurrent")
    times = await concurrent_phase(url, args, conc, tally)
    short = summary(conc, "short")
    ctx = summary(conc, "context")
    gen_all = short["generated_tokens"] + ctx["generated_tokens"]
    result.update({
        "aggregate_tokens_per_s": round(short["generated_tokens"] / times["short_s"], 2),
        "latency_ms": short["latency_ms"],
        "ttft_ms": short["ttft_ms"],
        "context_turns": {**ctx, "wall_s": round(times["context_s"], 2)},
        "concurrent": {**short, "wall_s": round(times["short_s"], 2)},
    })
    errors = errors_of(conc)
    mid = await server_stats(url, args)
    if "batch_decode_steps" in mid and "batch_decode_steps" in before:
        steps = mid["batch_decode_steps"] - before["batch_decode_steps"]
        tokens = mid["batch_decode_tokens"] - before["batch_decode_tokens"]
        result["concurrent"]["server_mean_decode_batch"] = round(tokens / max(1, steps), 2)
    if not args.no_sequential:
        seq = conversations(args)
        tally.start("sequential")
        seq_times = await sequential_phase(url, args, seq, tally)
        seq_short, seq_ctx = summary(seq, "short"), summary(seq, "context")
        seq_all = seq_short["generated_tokens"] + seq_ctx["generated_tokens"]
        errors += errors_of(seq)
        result.update({
            "sequential_tokens_per_s": round(seq_short["generated_tokens"] / seq_times["short_s"], 2),
            "sequential": {**seq_short, "wall_s": round(seq_times["short_s"], 2)},
        })
        result["speedup"] = round(result["aggregate_tokens_per_s"] / result["sequential_tokens_per_s"], 2)
        result["generated_tokens"] = {"concurrent": short["generated_tokens"], "sequential": seq_short["generated_tokens"]}
        result["with_context"] = {
            "aggregate_tokens_per_s": round(gen_all / times["total_s"], 2),
            "sequential_tokens_per_s": round(seq_all / seq_times["total_s"], 2),
            "speedup": round((gen_all / times["total_s"]) / (seq_all / seq_times["total_s"]), 2),
            "concurrent_wall_s": round(times["total_s"], 2),
            "sequential_wall_s": round(seq_times["total_s"], 2),
        }
    after = await server_stats(url, args)
    result["errors"] = len(errors)
    if errors:
        result["error_samples"] = errors[:10]
    result["peak_device_bytes"] = after.get("peak_device_bytes")
    result["device_budget_bytes"] = after.get("device_budget_bytes")
    budget = after.get("device_budget_bytes") or 0
    if budget and after.get("peak_device_bytes") is not None:
        result["peak_within_budget"] = after["peak_device_bytes"] <= budget
    result["server"] = {"before": before, "after_concurrent": mid, "after": after}
    return result


def main(args) -> int:
    if args.sessions is None:
        args.sessions = 16
    result = asyncio.run(run(args))
    write_json(result, args.json_out)
    return 0 if result["errors"] == 0 else 1
