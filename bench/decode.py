"""``rocketkv-mt bench decode``: decode speed, attention time and device KV bytes per cache mode.

All modes run in one process on the same context; decode rounds alternate between modes so that
machine noise hits them alike. Reported figures are medians over every measured token.
"""
from __future__ import annotations

import statistics
import time

from bench.common import context_ids, load_engine, write_json
from rocketkv_mt.config import RocketKVConfig


def main(args) -> int:
    engine = load_engine()
    runner, tok = engine.runner, engine.tokenizer
    modes = [m for m in args.modes.split(",") if m]
    ids = context_ids(tok, args.context, "Summarise the text above in one sentence.")
    rounds = max(1, args.rounds)
    per_round = -(-max(32, args.tokens) // rounds)
    total_new = per_round * rounds
    rocket = RocketKVConfig(token_budget=args.budget)
    caches, next_tok, prefill_s = {}, {}, {}
    for mode in modes:
        cache = engine.new_cache(mode, rocket, f"bench-{mode}")
        t0 = time.perf_counter()
        logits = runner.forward(ids, cache, prefill=True, max_new=total_new)
        prefill_s[mode] = time.perf_counter() - t0
        caches[mode], next_tok[mode] = cache, int(logits.argmax())
    step_ms = {m: [] for m in modes}
    attn_ms = {m: [] for m in modes}
    for _ in range(rounds):
        for mode in modes:
            cache = caches[mode]
            cache.timer.enabled = True
            for _ in range(per_round):
                before = cache.timer.seconds
                t0 = time.perf_counter()
                logits = runner.forward([next_tok[mode]], cache, prefill=False)
                step_ms[mode].append((time.perf_counter() - t0) * 1000)
                attn_ms[mode].append((cache.timer.seconds - before) * 1000)
                next_tok[mode] = int(logits.argmax())
            cache.timer.enabled = False
    result = {
        "context": len(ids),
        "budget": args.budget,
        "decode_tokens_per_mode": total_new,
        "split": vars(rocket.split(len(ids) + total_new, total_new, runner.spec.head_dim)),
        "modes": {
            mode: {
                "decode_ms_per_token": round(statistics.median(step_ms[mode]), 3),
                "attention_ms_per_token": round(statistics.median(attn_ms[mode]), 3),
                "device_kv_bytes": caches[mode].device_bytes(),
                "device_tokens_per_head": caches[mode].kept_tokens(),
                "prefill_s": round(prefill_s[mode], 2),
            }
            for mode in modes
        },
    }
    full = result["modes"].get("full")
    if full:
        for mode, r in result["modes"].items():
            if mode != "full":
                r["attention_speedup_vs_full"] = round(full["attention_ms_per_token"] / r["attention_ms_per_token"], 2)
                r["decode_speedup_vs_full"] = round(full["decode_ms_per_token"] / r["decode_ms_per_token"], 2)
                r["device_bytes_vs_full"] = round(r["device_kv_bytes"] / full["device_kv_bytes"], 4)
    write_json(result, args.json_out)
    return 0
