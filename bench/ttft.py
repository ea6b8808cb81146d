"""``rocketkv-mt bench ttft``: time to first token of a later turn, stateful vs stateless, in one run.

Stateful: a session (``--mode``, tiered by default) takes turns 1..T-1 (the first carries about
``--context`` tokens of filler, the others are short), then turn T; its time to first token is
what the engine reports for turn T (message received to first token's logits: only the new turn
is prefilled on top of the kept cache). Repeated on ``--repeats`` identical sessions; the median
is reported.

Stateless: the same conversation up to turn T-1 (the same token ids) given to a fresh session
with an empty cache, then the same turn T: the whole conversation is prefilled, as a server
without session state must do on every turn. Measured for the same mode and for ``full``.
"""
from __future__ import annotations

import statistics

from app.engine.sampling import SamplingParams
from bench.common import fit_words, load_engine, run_async, write_json
from bench.haystack import filler_text

EARLIER = ["Which colours are mentioned in it?", "What runs past the old mill?", "Where does the road bend?",
           "Name one thing that happens on weekdays.", "What gathers over the valley?"]
MEASURED = "Thanks. Now summarise our whole conversation in two sentences."
PARAMS = SamplingParams(max_tokens=24)


def first_message(tokenizer, n_tokens: int) -> str:
    return fit_words(tokenizer, filler_text(n_tokens, seed=3), n_tokens) + "\n\nWhat is this text about?"


async def stateful(engine, mode: str, budget: int, first: str, earlier: list[str]):
    session = engine.create_session(mode=mode, budget=budget)
    for text in [first, *earlier]:
        await engine.complete(session.id, text, PARAMS)
    history = (list(session.messages), list(session.token_ids))
    done = await engine.complete(session.id, MEASURED, PARAMS)
    return session, history, done


async def stateless(engine, mode: str, budget: int, history):
    session = engine.create_session(mode=mode, budget=budget)
    session.messages, session.token_ids = list(history[0]), list(history[1])
    done = await engine.complete(session.id, MEASURED, PARAMS)
    await engine.delete_session(session.id)
    return done


async def run(args) -> dict:
    engine = load_engine(token_budget=args.budget)
    try:
        earlier = EARLIER[: max(0, args.turn - 2)]
        # The first message leaves room for the short turns, so the history before turn T is ~context.
        first = first_message(engine.tokenizer, max(64, args.context - 70 * len(earlier) - 30))
        runs = []
        for _ in range(max(1, args.repeats)):
            session, history, done = await stateful(engine, args.mode, args.budget, first, earlier)
            runs.append((session, done))
        ttfts = [d.ttft_ms for _, d in runs]
        session, done = runs[0]
        result = {
            "turn": args.turn,
            "history_tokens": len(history[1]),
            "mode": args.mode,
            "token_budget": args.budget,
            "stateful": {
                "ttft_ms": round(statistics.median(ttfts), 1),
                "ttft_ms_runs": [round(t, 1) for t in ttfts],
                "prefilled_tokens": done.usage.prefilled_tokens,
                "prompt_tokens": done.usage.prompt_tokens,
                "device_bytes": done.memory.device_bytes,
                "reply": done.text,
            },
            "stateless": {},
        }
        for s, _ in runs:
            await engine.delete_session(s.id)
        for mode in dict.fromkeys([args.mode, "full"]):
            d = await stateless(engine, mode, args.budget, history)
            result["stateless"][mode] = {
                "ttft_ms": round(d.ttft_ms, 1),
                "prefilled_tokens": d.usage.prefilled_tokens,
                "same_reply_as_stateful": d.text == done.text,
                "reply": d.text,
            }
            write_json(result, args.json_out, quiet=True)
        base = result["stateful"]["ttft_ms"]
        result["speedup"] = {m: round(r["ttft_ms"] / base, 1) for m, r in result["stateless"].items()}
    finally:
        engine.close()
    return result


def main(args) -> int:
    return run_async(run, args)
