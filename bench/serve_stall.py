"""``rocketkv-mt bench serve --stall``: how long a long message stalls the replies that other
sessions are streaming, against a running server.

S WebSocket sessions (``--sessions``, 8 here by default) each ask for a long reply
(``--stall-reply-tokens``, greedy; the bundled model keeps going to the cap). Once every one of them
streams, the bench records ``--stall-baseline`` seconds of their deltas, then one more session sends
a first message of about ``--stall-tokens`` tokens (filler) and waits for its first delta. From the
client's arrival times of the S streams' deltas:

- ``gap_before_p95_ms``: the 95th percentile of the gaps between consecutive deltas of a stream,
  over the baseline window (every stream's gaps pooled);
- ``max_pause_ms``: the longest gap between two deltas of one stream that overlaps the long
  message's prefill (from its send to its first delta);
- ``ratio``: max pause / p95 gap before (the target is at most 3);
- ``longest_pauses``: the five longest of those gaps and when each began, in seconds after the long
  message was sent (pauses just before its first token come from its end-of-prefill selection).

Also reported: the long message's time to first token and prompt tokens (from its ``done``), the
p95 of the gaps during its prefill, and the server's batching counters over the run (prefill
chunks and steps). Then the streams are cancelled and closed.

``--stall-turn K`` (default 1) sends the long message as the K-th turn of its session instead: before
the streams start, that session gets a first message of about ``--stall-history`` tokens and K - 2
short questions, so a ``tiered`` session (budget below that history) has cold pages when the long
message arrives, as a pasted document in a running conversation does.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time

from app.progress import progress
from bench.common import GREEDY, write_json
from bench.haystack import filler_text
from bench.serve_load import CONTEXT_QUESTION, Session, open_session, pct, server_stats

STREAM_PROMPTS = [
    "Tell a very long story about a river, a mill and a village, chapter after chapter, with many details.",
    "Write a long essay about the history of bread, in many paragraphs.",
    "Describe, in great detail and at length, a journey across the mountains.",
    "Write a long letter to a friend about a year spent by the sea, with many details.",
]
TOKENS_PER_WORD = 1.22  # the bundled tokenizer on the filler (the ``done`` event reports the real count)


class Stream:
    """One session streaming a long reply; the arrival time of each of its deltas."""

    def __init__(self, ws, args, index: int):
        self.session = Session(ws, args)
        self.args = args
        self.prompt = STREAM_PROMPTS[index % len(STREAM_PROMPTS)]
        self.times: list[float] = []
        self.ended: float | None = None
        self.error: str | None = None

    async def run(self) -> None:
        await self.session.create()
        message = {"type": "message", "content": self.prompt, "max_tokens": self.args.stall_reply_tokens,
                   **GREEDY}
        await self.session.ws.send(json.dumps(message))
        while True:
            event = await self.session.recv()
            if event["type"] == "delta":
                self.times.append(time.perf_counter())
            elif event["type"] in ("done", "error"):
                self.ended = time.perf_counter()
                if event["type"] == "error":
                    self.error = f"{event.get('code')}: {event.get('message')}"
                return

    def gaps(self, start: float, stop: float) -> list[float]:
        """Gaps between consecutive deltas that overlap [start, stop], in seconds."""
        return [b - a for a, b in self.timed_gaps(start, stop)]

    def timed_gaps(self, start: float, stop: float) -> list[tuple[float, float]]:
        """(start, end) of each gap between consecutive deltas that overlaps [start, stop]."""
        return [(a, b) for a, b in zip(self.times, self.times[1:]) if b > start and a < stop]


async def send(session: Session, text: str, max_tokens: int) -> dict:
    """One turn of ``session``: its send and first-delta times and its ``done`` usage."""
    sent = time.perf_counter()
    await session.ws.send(json.dumps({"type": "message", "content": text, "max_tokens": max_tokens, **GREEDY}))
    first = None
    while True:
        event = await session.recv()
        if event["type"] == "delta" and first is None:
            first = time.perf_counter()
        elif event["type"] == "done":
            return {"sent": sent, "first": first or time.perf_counter(), "usage": event["usage"]}
        elif event["type"] == "error":
            raise RuntimeError(f"{event.get('code')}: {event.get('message')}")


async def history(session: Session, args) -> list[int]:
    """The turns before the long message (``--stall-turn`` - 1 of them): a first message of about
    ``--stall-history`` tokens, then short questions; the prompt tokens of each."""
    turns = []
    for k in range(args.stall_turn - 1):
        text = (filler_text(int(args.stall_history / TOKENS_PER_WORD), seed=11) + CONTEXT_QUESTION if k == 0
                else "Say in one sentence what the last paragraph was about.")
        turns.append((await send(session, text, 16))["usage"]["prompt_tokens"])
    return turns


def long_text(args) -> str:
    return filler_text(int(args.stall_tokens / TOKENS_PER_WORD), seed=7) + CONTEXT_QUESTION


async def stall(url: str, args) -> dict:
    """The run's three stages (streams started, the baseline, the long message's first token), a bar of
    them on a terminal (``--quiet``: none)."""
    with progress(3, "bench serve --stall", quiet=args.quiet, unit="stage") as bar:
        return await _stall(url, args, bar)


async def _stall(url: str, args, bar) -> dict:
    async with contextlib.AsyncExitStack() as stack:
        asking = Session(await stack.enter_async_context(open_session(url, args)), args)
        await asking.create()
        earlier = await history(asking, args)  # before the streams: their baseline sees none of it
        sockets = [await stack.enter_async_context(open_session(url, args)) for _ in range(args.sessions)]
        streams = [Stream(ws, args, i) for i, ws in enumerate(sockets)]
        tasks = [asyncio.create_task(s.run()) for s in streams]
        try:
            while min(len(s.times) for s in streams) < 3:  # every stream has started
                if any(t.done() for t in tasks):
                    raise RuntimeError(f"a stream ended before the long message: {[s.error for s in streams]}")
                await asyncio.sleep(0.1)
            bar.set_postfix_str(f"{len(streams)} streams; baseline {args.stall_baseline:.0f} s")
            bar.update()
            await asyncio.sleep(args.stall_baseline)
            bar.set_postfix_str(f"the long message ({args.stall_tokens} tokens) in prefill")
            bar.update()
            before = await server_stats(url, args)
            long = await send(asking, long_text(args), 8)
            bar.set_postfix_str(f"first token after {long['first'] - long['sent']:.1f} s")
            bar.update()
            after = await server_stats(url, args)
        finally:
            for ws, task in zip(sockets, tasks):
                if not task.done():
                    await ws.send(json.dumps({"type": "cancel"}))
            await asyncio.wait(tasks, timeout=120)
    sent, first = long["sent"], long["first"]
    baseline = [g for s in streams for g in s.gaps(sent - args.stall_baseline, sent)]
    during = [g for s in streams for g in s.gaps(sent, first)]
    # Where the longest pauses fell (seconds after the long message was sent): early ones point at the
    # chunks, ones near its first token at the end-of-prefill selection.
    longest = sorted((b - a, a) for s in streams for a, b in s.timed_gaps(sent, first))[-5:]
    p95_before = pct([g * 1000 for g in baseline], 0.95)
    max_pause = round(max(during) * 1000, 1) if during else None
    counters = ("batch_steps", "batch_prefill_chunks", "batch_layered_slices", "batch_layered_deferred",
                "batch_prefills", "batch_mixed_steps", "batch_decode_tokens")
    return {
        "gap_before_p95_ms": p95_before,
        "max_pause_ms": max_pause,
        "ratio": round(max_pause / p95_before, 2) if max_pause and p95_before else None,
        "longest_pauses": [{"ms": round(g * 1000, 1), "at_s": round(a - sent, 2)} for g, a in reversed(longest)],
        "gaps_during_p95_ms": pct([g * 1000 for g in during], 0.95),
        "baseline_gaps": len(baseline),
        "gaps_during": len(during),
        "streams_ended_during_prefill": sum(1 for s in streams if s.ended is not None and s.ended < first),
        "long_message": {"turn": args.stall_turn, "prompt_tokens": long["usage"]["prompt_tokens"],
                         "prefilled_tokens": long["usage"].get("prefilled_tokens"), "ttft_s": round(first - sent, 2),
                         "earlier_prompt_tokens": earlier},
        "server_during_prefill": {k: after.get(k, 0) - before.get(k, 0) for k in counters if k in after},
        "errors": [s.error for s in streams if s.error],
    }


async def run(args) -> dict:
    url = args.url.rstrip("/")
    result = {
        "url": url,
        "sessions": args.sessions,
        "stall_tokens": args.stall_tokens,
        "reply_tokens": args.stall_reply_tokens,
        "baseline_s": args.stall_baseline,
        "mode": args.mode or "server default",
        "measured": "client arrival times of the streamed deltas of the sessions that were generating",
    }
    result.update(await stall(url, args))
    return result


def main(args) -> int:
    if args.sessions is None:
        args.sessions = 8
    result = asyncio.run(run(args))
    write_json(result, args.json_out)
    return 0 if not result["errors"] and result["max_pause_ms"] is not None else 1
