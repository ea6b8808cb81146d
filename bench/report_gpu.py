"""The GPU check's files (``bench/gpu_check.py``) as tables of ``docs/benchmarks.md``: e2e, the
check's summary, the kernel tests, the tiered conversation persisted to Redis and the profile of a
later turn."""
from __future__ import annotations

from collections.abc import Callable

from bench.tables import cell, mb, ms, table


def _e2e(d: dict) -> list[str]:
    """``bench e2e``: per context and mode, the prefill, the session's bytes and the second turn's
    first token; decode ms per step at each batch, with the speed-up over ``full`` beside it."""
    batches = list(dict.fromkeys(b for res in d["results"] for b in res["decode"]))
    rows = []
    for res in d["results"]:
        for mode, m in res["modes"].items():
            steps = []
            for b in batches:
                row = res["decode"].get(b, {}).get(mode, {})
                speedup = d["speedups"].get(f"{mode}_over_full", {}).get(f"{res['context']}_b{b}")
                steps.append("skipped" if "skipped" in row else "–" if "ms_per_step" not in row else
                             ms(row["ms_per_step"]) + (f" ({speedup:.2f}x)" if speedup else ""))
            rows.append([f"{res['context']:,}", f"`{mode}`", f"{m['prefill_s']:.2f} s", ms(m["ttft_second_turn_ms"]),
                         mb(m["session_device_bytes"]), mb(m["host_bytes"]), *steps])
    shapes = ", ".join(f"{k} {v}" for k, v in d["shapes"].items())
    lines = [f"Random-weight model ({shapes}), {d['dtype']} on {d['device']}, token budget {d['token_budget']}; "
             f"decode: median ms per batched step over {d['rounds']} rounds of {d['steps']} steps (speed-up over "
             f"`full` in brackets); second turn: {d['second_turn_tokens']} tokens after the reply.", ""]
    return lines + table(["context", "mode", "prefill", "2nd-turn first token", "session device", "host tier",
                           *(f"decode, batch {b}" for b in batches)], rows)


def _gpu_check(d: dict) -> list[str]:
    """The GPU check's summary: each part's outcome, time and estimate."""
    rows = [[f"`{name}`", p.get("headline") or (f"skipped: {p['skipped']}" if isinstance(p.get("skipped"), str) else
                                                f"**error**: {p['error'][:200]}" if "error" in p else
                                                "see its file"),
             f"{p['wall_s']:.0f} s", f"{d['estimates_s'].get(name, 0):.0f} s"] for name, p in d["parts"].items()]
    lines = [f"{d['device']}, torch {d['torch']}; {d['wall_s']:.0f} s of a {d['budget_s']:.0f} s budget.", ""]
    return lines + table(["part", "outcome", "took", "estimated"], rows)


def _kernel_tests(d: dict) -> list[str]:
    lines = ["The Triton kernel tests, compiled for the device.", ""]
    lines += table(["tests", "passed", "failed", "errors", "skipped"],
                    [[d["tests"], f"**{d['passed']}**", d["failures"], d["errors"], d["skipped"]]])
    if d["failed"]:
        shown = ", ".join(f"`{t.split('::')[-1]}`" for t in d["failed"][:8])
        lines += ["", f"Failed: {shown}" + (f" and {len(d['failed']) - 8} more" if len(d["failed"]) > 8 else "") + "."]
    if d.get("first_failure"):
        lines += ["", "The first failure: `" + cell(d["first_failure"])[-400:].replace("`", "'") + "`"]
    return lines


def _tiered_redis(d: dict) -> list[str]:
    rows = [[i, ms(t["ttft_ms"]), t["prefilled_tokens"], t["generated_tokens"], mb(t["device_bytes"]),
             mb(t["host_bytes"]), mb(t["redis_bytes"]), t["readmitted_tokens"], mb(t["cold_bytes_read"]),
             mb(t["redis_bytes_written"])] for i, t in enumerate(d["turns"], 1)]
    lines = [f"A `tiered` session's turns on {d['device']} ({d['model']}), persisted to a {d['redis']} Redis "
             "after each.", ""]
    return lines + table(["turn", "first token", "prefilled", "generated", "device", "host tier", "Redis",
                           "re-admitted tokens", "cold bytes read", "Redis bytes written"], rows)


def _turn_profile(d: dict, shown: int = 10) -> list[str]:
    """``bench turn-profile``: each mode's second turn, then its functions by self time (profiled)."""
    shapes = ", ".join(f"{k} {v}" for k, v in d["shapes"].items())
    lines = [f"A {d['second_turn_tokens']}-token second turn after a {d['context']:,}-token first one, random-weight "
             f"model ({shapes}), {d['dtype']} on {d['device']}, token budget {d['token_budget']}.", ""]
    lines += table(["mode", "second turn, first token", "the same profiled", "Python calls"],
                   [[f"`{mode}`", ms(m["ttft_second_turn_ms"]), ms(m["profiled_ttft_ms"]), m["python_calls"]]
                    for mode, m in d["modes"].items()])
    for mode, m in d["modes"].items():
        lines += ["", f"`{mode}`, the {shown} functions the profiled turn spent most time in:", ""]
        lines += table(["function", "calls", "self", "with callees"],
                       [[f"`{f['function']}`", f["calls"], ms(f["self_ms"]), ms(f["cumulative_ms"])]
                        for f in m["top"][:shown]])
    return lines


GPU_TABLES: dict[str, Callable[[dict], list[str]]] = {
    "e2e": _e2e, "gpu-check": _gpu_check, "kernel-tests": _kernel_tests, "tiered-redis": _tiered_redis,
    "turn-profile": _turn_profile,
}
