"""``rocketkv-mt bench turn-profile``: where the host's time goes in a later turn, per cache mode.

A random-weight model (``bench.random_model``; SmolLM2-135M's shapes by default) prefills a context
in each mode (as ``bench e2e`` does), decodes a token, then takes a short second turn twice: once
timed, once under ``cProfile``. Reported per mode: the timed turn's time to first token, the Python
calls the profiled one made, and its functions by time spent in themselves (``top``). On a GPU the
kernels run asynchronously, so what remains on the host (Python bookkeeping, launches, the waits of
``.tolist()``/``.item()``/``.any()``) is what such a turn costs beyond the device's work: the list
says which code to move onto the device or batch.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats


from bench import e2e
from bench.common import write_json

TOP = 20


def _top(stats: pstats.Stats, n: int) -> list[dict]:
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:n]  # (cc, nc, tottime, cumtime, callers)
    return [{"function": f"{file.rsplit('/', 1)[-1]}:{line}({name})" if line else name, "calls": nc,
             "self_ms": round(tt * 1e3, 3), "cumulative_ms": round(ct * 1e3, 3)}
            for (file, line, name), (_, nc, tt, ct, _) in rows]


def run(args) -> dict:
    bench = e2e.Bench(argparse.Namespace(
        contexts=str(args.context), batches="1", modes=args.modes, shapes=args.shapes, device=args.device,
        budget=args.budget, max_new=args.max_new, steps=1, rounds=1, warmup=0, second_turn=args.second_turn,
        rows=args.rows, json_out=None))
    bench.warm_up()
    result = {"context": args.context, "second_turn_tokens": args.second_turn, "token_budget": args.budget,
              "shapes": bench.shapes, "device": str(bench.device), "dtype": str(bench.dtype), "modes": {}}
    for mode in bench.modes:
        state = bench.prefill(mode, args.context)
        state["token"] = bench.step(state["runner"], [state["cache"]], [state["token"]])[0]
        timed = bench.second_turn(state)
        profile = cProfile.Profile()
        profile.enable()
        profiled = bench.second_turn(state)
        profile.disable()
        stats = pstats.Stats(profile)
        result["modes"][mode] = {"ttft_second_turn_ms": timed, "profiled_ttft_ms": profiled,
                                 "python_calls": stats.total_calls, "top": _top(stats, TOP)}
        state["cache"].release()
        print(f"{mode:10s} second turn {timed:8.1f} ms, {stats.total_calls} Python calls profiled", flush=True)
    write_json(result, args.json_out, quiet=True)
    return result


def main(args) -> int:
    run(args)
    return 0
