"""``rocketkv-mt bench scaling``: what a turn costs as the history grows, per mode, in one process.

For each history length, each mode holds the same conversation: a first message of about that many
tokens (filler and a question), then two short turns. Reported per mode and length: the first turn's
and the third turn's time to first token, the third turn's wall time, the bytes it moved per tier
(cold pages read from the host tier and from Redis, digests scored, pages demoted, bytes written to
Redis) and the device bytes, next to the history's whole KV (what ``full`` holds). Modes alternate
within each length, so they share the machine's state; compare ratios, not absolute times. With
``--repeats R`` each mode holds the conversation R times (the order of the modes reversed each
time) and the times are the medians, so one slow turn on a shared machine does not decide a ratio.
A mode whose settings differ runs on an engine of its own, and only one engine is open at a time
(``Engines.alone``): one model thread works in the process, as in a replica.

Modes: ``full``, ``rocketkv-mt``, ``tiered-exhaustive`` (every cold page read back each turn) and
``tiered-digest`` (only the pages whose key digests rank highest). On a terminal a bar counts the
conversations, with the last one's third-turn TTFT (``--quiet``: none).
"""
from __future__ import annotations

import statistics
from pathlib import Path

from app.engine.sampling import SamplingParams
from app.progress import progress
from bench.common import TRAFFIC_FIELDS, Engines, fit_words, run_async, variant, write_json
from bench.haystack import filler_text

LATER = ["Which colours are mentioned in it?", "Where does the road bend, and what runs past the old mill?"]


def turn_record(done) -> dict:
    mem = done.memory
    rec = {"ttft_ms": round(done.ttft_ms, 1), "wall_ms": round(done.latency_ms, 1),
           "prompt_tokens": done.usage.prompt_tokens, "prefilled_tokens": done.usage.prefilled_tokens, "device_bytes": mem.device_bytes,
           "host_bytes": mem.host_bytes, "redis_bytes": mem.redis_bytes,
           "readmitted_tokens": mem.readmitted_tokens}
    rec.update({k: getattr(mem, k) for k in TRAFFIC_FIELDS})
    rec["bytes_read"] = mem.cold_bytes_read + mem.digest_bytes_read
    return rec


def median_turn(runs: list[dict]) -> dict:
    """One turn's record over repeated conversations: times are the medians (each run's kept in
    ``*_runs``), bytes and counts those of the last run (the same in every run)."""
    out = dict(runs[-1])
    for key in ("ttft_ms", "wall_ms"):
        values = [r[key] for r in runs]
        out[key] = round(statistics.median(values), 1)
        if len(runs) > 1:
            out[f"{key}_runs"] = values
    return out


async def conversation(engine, mode: str, budget: int, first: str, params: SamplingParams) -> list[dict]:
    session = engine.create_session(mode=mode, budget=budget)
    try:
        return [turn_record(await engine.complete(session.id, text, params)) for text in [first, *LATER]]
    finally:
        await engine.delete_session(session.id)


def plot(result: dict, path: str) -> None:
    """``--plot``: the figure ``bench plot`` draws of this result."""
    from bench.plot import render
    from bench.results import Result

    render(Result(Path(path), result), Path(path))


async def run(args) -> dict:
    lengths = [int(x) for x in args.lengths.split(",") if x]
    modes = [m for m in args.modes.split(",") if m]
    base = {"token_budget": args.budget}
    if args.redis_url:
        base.update(redis_url=args.redis_url, redis_namespace="rkvbench-scaling")
    if args.host_tier_bytes:
        base["host_tier_bytes"] = args.host_tier_bytes
    engines = Engines(quiet=args.quiet, **base)
    some = engines.get({})
    repeats = max(1, args.repeats)
    bar = progress(len(lengths) * repeats * len(modes), "bench scaling", quiet=args.quiet, unit="conversation")
    params = SamplingParams(max_tokens=args.max_tokens)
    result = {"model": some.settings.model, "device": str(some.runner.device), "token_budget": args.budget,
              "max_tokens": args.max_tokens, "repeats": max(1, args.repeats), "modes": modes, "lengths": []}
    try:
        for i, length in enumerate(lengths):
            first = fit_words(some.tokenizer, filler_text(length, seed=7 + i), length - 40)
            first += "\n\nWhat is this text about? Answer in one sentence."
            row = {"target_tokens": length, "modes": {}}
            runs: dict[str, list[list[dict]]] = {mode: [] for mode in modes}
            for rep in range(max(1, args.repeats)):
                order = modes if (i + rep) % 2 == 0 else list(reversed(modes))
                for mode in order:
                    cache_mode, overrides = variant(mode)
                    engine = engines.alone(overrides)  # one model thread at a time, as in a replica
                    runs[mode].append(await conversation(engine, cache_mode, args.budget, first, params))
                    turn3 = runs[mode][-1][-1]
                    bar.set_postfix_str(f"{length} tokens, {mode}: turn 3 TTFT {turn3['ttft_ms']:.0f} ms")
                    bar.update()
            for mode in modes:
                row["modes"][mode] = {f"turn{t + 1}": median_turn([run[t] for run in runs[mode]]) for t in range(3)}
            full3 = row["modes"].get("full", {}).get("turn3")
            # The history's whole KV: every layer's keys and values of every token before turn 3's reply.
            row["history_tokens"] = history = _history_tokens(row, modes)
            row["history_kv_bytes"] = history * some.memory_account.per_token
            for mode in modes:
                t1, t3 = row["modes"][mode]["turn1"], row["modes"][mode]["turn3"]
                t3["bytes_read_vs_history_kv"] = round(t3["bytes_read"] / row["history_kv_bytes"], 4)
                if full3 is not None:
                    t3["ttft_vs_full"] = round(t3["ttft_ms"] / full3["ttft_ms"], 3)
                    t1["ttft_vs_full"] = round(t1["ttft_ms"] / row["modes"]["full"]["turn1"]["ttft_ms"], 3)
            result["lengths"].append(row)
            write_json(result, args.json_out, quiet=True)
    finally:
        bar.close()
        engines.close()
    if args.plot:
        plot(result, args.plot)
    return result


def _history_tokens(row: dict, modes: list[str]) -> int:
    """Tokens of history turn 3 prefills on: its prompt minus what it fed (the same in every mode)."""
    t = row["modes"][modes[0]]
    return t["turn3"]["prompt_tokens"] - t["turn3"]["prefilled_tokens"]


def main(args) -> int:
    return run_async(run, args)
