"""``rocketkv-mt bench rounds``: where a round of concurrent short turns goes, in this process.

The conversations of ``bench serve`` (each session a context message of about ``--context`` tokens,
then short turns of ``--max-tokens`` greedy tokens), on an engine built here from the server's
settings (the ``RKV_*`` environment), with no HTTP in between: all sessions send their context
together, then ``--rounds`` rounds in which every session sends its next short turn at once; then
``--alone`` sessions each send one more turn with nothing else running. Every model step is recorded
(``Batcher.step_log``), so a round is told as its prefill steps and its decode steps (count,
seconds, median), beside a turn alone. ``ratio`` is sessions x (a turn alone) over a round: what
``bench serve`` measures over the network, without it.
"""
from __future__ import annotations

import asyncio
import statistics
import time

from app.engine.engine import Engine
from app.engine.sampling import SamplingParams
from app.engine.steps import StepLog, StepRecord
from app.settings import Settings
from bench.common import write_json
from bench.serve_load import SHORT_TURNS, context_text


def phase(records: list[StepRecord], wall_s: float, done: list) -> dict:
    """A phase's wall time, its turns (their ``TurnDone``s) and its steps: those that fed prefill
    tokens and those that only decoded."""
    prefill = [r for r in records if r.prefills]
    decode = [r for r in records if not r.prefills]
    return {
        "wall_s": round(wall_s, 3),
        "turns": len(done),
        "prefilled_tokens": sum(d.usage.prefilled_tokens for d in done),
        "generated_tokens": sum(d.usage.generated_tokens for d in done),
        "prefill_steps": len(prefill),
        "prefill_tokens": sum(r.prefill_tokens for r in prefill),
        "prefill_s": round(sum(r.seconds for r in prefill), 3),
        "decode_steps": len(decode),
        "decode_tokens": sum(r.decodes for r in records),
        "decode_s": round(sum(r.seconds for r in decode), 3),
        "decode_step_ms_median": round(statistics.median(r.seconds for r in decode) * 1e3, 2) if decode else None,
        "mean_decode_batch": round(sum(r.decodes for r in decode) / len(decode), 2) if decode else None,
    }


async def timed(engine: Engine, log: StepLog, turns: list[tuple[str, str]], params: SamplingParams) -> dict:
    """Send ``turns`` ((session id, text)) at once; the phase they make (``phase``)."""
    start, t0 = len(log), time.perf_counter()
    done = await asyncio.gather(*[engine.complete(sid, text, params) for sid, text in turns])
    wall = time.perf_counter() - t0
    return phase(log.since(start), wall, done)


async def run(args, engine: Engine | None = None) -> dict:
    """The phases on ``engine`` (default: one built here from the environment's settings, and closed)."""
    own = engine is None
    engine = engine or Engine.from_settings(Settings())
    log = StepLog()
    engine.batcher.step_log = log
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    try:
        sessions = [engine.create_session(mode=args.mode).id for _ in range(args.sessions)]
        context = await timed(engine, log, [(sid, context_text(args.context, seed=100 + i))
                                            for i, sid in enumerate(sessions)], params)
        rounds = []
        for r in range(args.rounds):
            rounds.append(await timed(engine, log, [(sid, SHORT_TURNS[(i + r) % len(SHORT_TURNS)])
                                                    for i, sid in enumerate(sessions)], params))
        alone = []
        for i, sid in enumerate(sessions[: args.alone]):
            alone.append(await timed(engine, log, [(sid, SHORT_TURNS[(i + args.rounds) % len(SHORT_TURNS)])], params))
    finally:
        engine.batcher.step_log = None
        if own:
            engine.close()
    result = {
        "sessions": args.sessions, "context": args.context, "max_tokens": args.max_tokens,
        "mode": args.mode or engine.settings.mode,
        "measured": "in-process; every model step recorded; a round: every session's next short turn at once",
        "context_phase": context, "rounds": rounds, "alone": alone,
    }
    if rounds and alone:
        turn_alone = statistics.median(a["wall_s"] for a in alone)
        round_s = statistics.median(r["wall_s"] for r in rounds)
        result["ratio"] = round(args.sessions * turn_alone / round_s, 2)
    return result


def main(args) -> int:
    result = asyncio.run(run(args))
    for i, r in enumerate(result["rounds"]):
        print(f"round {i + 1}: {r['wall_s']} s; prefill {r['prefill_steps']} step(s) {r['prefill_s']} s; "
              f"decode {r['decode_steps']} steps, median {r['decode_step_ms_median']} ms")
    for a in result["alone"]:
        print(f"alone: {a['wall_s']} s; prefill {a['prefill_s']} s; decode median {a['decode_step_ms_median']} ms")
    if "ratio" in result:
        print(f"ratio (sessions x a turn alone / a round): {result['ratio']}x")
    write_json(result, args.json_out, quiet=True)
    return 0
