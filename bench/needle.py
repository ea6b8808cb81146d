"""``rocketkv-mt bench needle``: single-turn pass-key retrieval in long filler, per cache mode (on a
terminal, a bar of the cases with each mode's running accuracy)."""
from __future__ import annotations

import random
import time

from app.progress import progress
from bench.common import chat_prompt_ids, fit_words, load_engine, write_json
from bench.haystack import filler_text
from rocketkv_mt.config import RocketKVConfig

QUESTION = "What is the pass key? Answer with the number only."
DEPTHS = [0.1, 0.35, 0.6, 0.85, 0.5, 0.2, 0.7, 0.95]


def needle_prompt(tokenizer, n_tokens: int, key: str, depth: float, seed: int) -> list[int]:
    """~n_tokens of filler with the pass key stated at ``depth``, then the question."""
    intro = "There is important information hidden in a lot of irrelevant text. Find it and remember it."
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    budget = n_tokens - len(chat_prompt_ids(tokenizer, intro + needle + QUESTION)) - 8
    filler = fit_words(tokenizer, filler_text(n_tokens, seed), budget)
    at = filler.find(". ", int(len(filler) * depth))
    at = len(filler) if at < 0 else at + 2
    return chat_prompt_ids(tokenizer, f"{intro} {filler[:at]}{needle} {filler[at:]}\n\n{QUESTION}")


def greedy_reply(runner, tokenizer, ids, cache, max_new: int, eos: set[int]) -> str:
    logits = runner.forward(ids, cache, prefill=True, max_new=max_new)
    out = []
    for _ in range(max_new):
        tok = int(logits.argmax())
        if tok in eos:
            break
        out.append(tok)
        logits = runner.forward([tok], cache, prefill=False)
    return tokenizer.decode(out, skip_special_tokens=True)


def main(args) -> int:
    engine = load_engine(quiet=args.quiet)
    runner, tok = engine.runner, engine.tokenizer
    modes = [m for m in args.modes.split(",") if m]
    lengths = [int(x) for x in args.lengths.split(",") if x]
    rng = random.Random(1234)
    rocket = RocketKVConfig(token_budget=args.budget, kernel_size=args.kernel_size or engine.settings.kernel_size)
    cases, per_mode, seen = [], {m: 0 for m in modes}, {m: 0 for m in modes}
    t0 = time.perf_counter()
    bar = progress(len(lengths) * args.cases * len(modes), "bench needle", quiet=args.quiet, unit="case")
    for length in lengths:
        for c in range(args.cases):
            key = str(rng.randint(10000, 99999))
            depth = DEPTHS[c % len(DEPTHS)]
            ids = needle_prompt(tok, length, key, depth, seed=length + c)
            row = {"length": len(ids), "depth": depth, "key": key, "replies": {}}
            for mode in modes:
                cache = engine.new_cache(mode, rocket, f"needle-{mode}-{len(cases)}")
                reply = greedy_reply(runner, tok, ids, cache, 12, engine.chat_format.eos_ids)
                cache.release()
                ok = key in reply
                per_mode[mode] += ok
                row["replies"][mode] = {"text": reply, "correct": ok}
                seen[mode] += 1
                bar.set_postfix_str(" ".join(f"{m} {per_mode[m] / seen[m]:.0%}" for m in modes if seen[m]))
                bar.update()
            cases.append(row)
            write_json(summarise(args, rocket, modes, lengths, cases, per_mode, t0, partial=True), args.json_out, quiet=True)
    bar.close()
    write_json(summarise(args, rocket, modes, lengths, cases, per_mode, t0), args.json_out)
    return 0


def summarise(args, rocket, modes, lengths, cases, per_mode, t0, partial: bool = False) -> dict:
    total = len(cases)
    return {
        "budget": args.budget,
        "kernel_size": rocket.kernel_size,
        "cases": total,
        "modes": {m: {"correct": per_mode[m], "total": total, "accuracy": round(per_mode[m] / max(total, 1), 3)} for m in modes},
        "per_length": {
            str(length): {m: sum(r["replies"][m]["correct"] for r in cases if abs(r["length"] - length) < length * 0.1) for m in modes}
            for length in lengths
        },
        "seconds": round(time.perf_counter() - t0, 1),
        "partial": partial,
        "details": cases,
    }
