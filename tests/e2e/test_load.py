"""Load: 32 concurrent WebSocket sessions x 3 short turns on the CPU; every turn completes, no errors.

The figures (turn latency p50/p95 as the client sees it, message sent to ``done``) are printed;
``pytest -s tests/e2e/test_load.py`` shows them. Against any running server:

    PYTHONPATH=tests python tests/e2e/test_load.py --url http://127.0.0.1:8000 [--sessions 32 --turns 3 --max-tokens 4 --api-key K]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx
from serving_helpers import WsChat, local_server, percentile

SESSIONS, TURNS, MAX_TOKENS = 32, 3, 4


async def run_load(ws_url: str, sessions: int = SESSIONS, turns: int = TURNS, max_tokens: int = MAX_TOKENS,
                   headers: dict | None = None) -> dict:
    """Every session on its own connection, all at once; each sends its next message when ``done`` arrives."""
    latencies: list[float] = []
    server_ms: list[float] = []
    errors: list[dict] = []

    async def converse(i: int) -> list[dict]:
        async with WsChat.open(ws_url, headers=headers) as chat:
            await chat.send({"type": "session.create"})
            event = await chat.recv(timeout=600)
            if event["type"] != "session":
                errors.append(event)
                return []
            dones = []
            for k in range(turns):
                start = time.perf_counter()
                _, done = await chat.turn(f"Session {i}, message {k}: say something short.", max_tokens=max_tokens)
                if done["type"] != "done":
                    errors.append(done)
                    continue
                latencies.append(time.perf_counter() - start)
                server_ms.append(done["latency_ms"])
                dones.append(done)
            return dones

    began = time.perf_counter()
    runs = await asyncio.gather(*(converse(i) for i in range(sessions)))
    wall = time.perf_counter() - began
    return {
        "sessions": sessions,
        "turns_per_session": turns,
        "max_tokens": max_tokens,
        "turns_done": len(latencies),
        "errors": errors,
        "wall_s": round(wall, 2),
        "turn_latency_p50_s": round(percentile(latencies, 50), 3) if latencies else None,
        "turn_latency_p95_s": round(percentile(latencies, 95), 3) if latencies else None,
        "server_turn_ms_p50": round(percentile(server_ms, 50), 1) if server_ms else None,
        "server_turn_ms_p95": round(percentile(server_ms, 95), 1) if server_ms else None,
        "generated_tokens": sum(d["usage"]["generated_tokens"] for run in runs for d in run),
        "runs": runs,
    }


async def test_32_sessions_by_3_turns_all_complete(loaded):
    with local_server(loaded) as srv:
        report = await run_load(srv.ws_url)
        assert report["errors"] == []
        assert report["turns_done"] == SESSIONS * TURNS
        for dones in report["runs"]:
            assert [d["finish_reason"] in ("stop", "length") for d in dones] == [True] * TURNS
            prompts = [d["usage"]["prompt_tokens"] for d in dones]
            assert prompts == sorted(prompts) and len(set(prompts)) == TURNS  # each turn saw the previous ones
        assert len({d["session_id"] for run in report["runs"] for d in run}) == SESSIONS
        assert httpx.get(f"{srv.url}/healthz").json()["status"] == "ok"
    summary = {k: v for k, v in report.items() if k != "runs"}
    print("\nload:", json.dumps(summary))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--sessions", type=int, default=SESSIONS)
    parser.add_argument("--turns", type=int, default=TURNS)
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    parser.add_argument("--api-key")
    args = parser.parse_args()
    ws_url = args.url.replace("http", "ws", 1).rstrip("/") + "/v1/chat/ws"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    report = asyncio.run(run_load(ws_url, args.sessions, args.turns, args.max_tokens, headers))
    report.pop("runs")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
