"""``rocketkv-mt bench capacity``: how many sessions with an N-token history one replica keeps on
its device at once, per cache mode, under one device budget.

Measured, not computed: one engine with that device budget and parking switched off; for each mode,
sessions are created one after another, each with a first message of about N tokens, until the
engine refuses a turn (``device_memory_exhausted``, decided by its admission bound before any
work) or ``--max-sessions`` is reached. The host tier, which holds what ``tiered`` demotes, is sized
by ``--host-bytes`` (16 GiB by default) so that it does not bind: a ``tiered`` session of an 8k
history leaves about 300 MB of cold KV there (float32 keys and values of the bundled model), so the
server's default 2 GiB without Redis would hold six of them and stop the count below what the
device keeps. A run that the host tier stops anyway says so (``refused_by``). Every admitted session stays resident on the device; the
count is how many were admitted, and the bytes are each session's measured ``device_bytes()``.
Without ``--device-budget``, the budget is 2.5x the measured bytes of one ``full`` session: room
for two ``full`` sessions and not three. On a terminal a bar per mode counts the sessions admitted, with
the device bytes they hold (``--quiet``: none).
"""
from __future__ import annotations

import statistics
import time

from app.engine.errors import DeviceMemoryExhausted, HostMemoryExhausted
from app.engine.sampling import SamplingParams
from app.progress import progress
from bench.common import fit_words, load_engine, run_async, write_json
from bench.haystack import filler_text

QUESTION = "\n\nWhat is this text about? Answer in one sentence."


def long_message(tokenizer, n_tokens: int, seed: int) -> str:
    """A first message of about n_tokens tokens (chat template included), different per seed."""
    return fit_words(tokenizer, filler_text(n_tokens, seed), max(16, n_tokens - 40)) + QUESTION


async def fill(engine, mode: str, context: int, token_budget: int, params: SamplingParams, max_sessions: int,
               on_session=None) -> dict:
    """Admit sessions of ``mode`` until the engine refuses one; they all stay resident. Returns the
    figures; the sessions are left in the engine (the caller deletes them)."""
    sessions, held, bounds, prefill_s = [], [], [], []
    refused = None
    while len(sessions) < max_sessions:
        session = engine.create_session(mode=mode, budget=token_budget)
        text = long_message(engine.tokenizer, context, seed=1000 * len(sessions) + 17)
        bounds.append(engine.memory_account.turn_bound(session, len(engine._turn_ids(session, text)), params.max_tokens))
        t0 = time.perf_counter()
        try:
            done = await engine.complete(session.id, text, params)
        except (DeviceMemoryExhausted, HostMemoryExhausted) as exc:
            await engine.delete_session(session.id)
            refused = "host" if isinstance(exc, HostMemoryExhausted) else "device"
            break
        prefill_s.append(round(time.perf_counter() - t0, 2))
        sessions.append(session)
        held.append(session.cache.device_bytes())
        if on_session is not None:
            on_session(len(sessions), done)
    resident = [s for s in sessions if s.cache is not None]
    assert len(resident) == len(sessions), "a session was parked although parking is off"
    return {
        "sessions": len(sessions),
        "device_bytes_per_session": int(statistics.mean(held)) if held else 0,
        "device_bytes_per_session_max": max(held, default=0),
        "history_tokens_per_session": int(statistics.mean(len(s.token_ids) for s in sessions)) if sessions else 0,
        "device_tokens_per_session": int(statistics.mean(s.cache.kept_tokens() for s in sessions)) if sessions else 0,
        "admission_bound_bytes": bounds[-1] if bounds else 0,
        "resident_device_bytes": sum(held),
        "refused_next": refused is not None,
        "refused_by": refused,
        "turn_s": prefill_s,
        "ids": [s.id for s in sessions],
    }


async def run(args) -> dict:
    engine = load_engine(quiet=args.quiet, token_budget=args.budget, device_budget_bytes=args.device_budget or 0,
                         host_tier_bytes=args.host_bytes)
    engine.parking = False  # every admitted session stays resident: that is what is counted
    params = SamplingParams(max_tokens=args.max_tokens)
    modes = [m for m in args.modes.split(",") if m]
    result = {
        "context": args.context,
        "token_budget": args.budget,
        "device_budget": args.device_budget or None,
        "max_new_tokens": args.max_tokens,
        "host_tier_bytes": args.host_bytes,
        "method": "measured: sessions admitted one by one by the engine's own admission control under the "
        "device budget, parking off, until it refused one; bytes are device_bytes() of each resident session",
        "modes": {},
    }
    try:
        if not args.device_budget:
            # The default budget needs one measured full session: take it as the first of `full`.
            probe = engine.create_session(mode="full", budget=args.budget)
            await engine.complete(probe.id, long_message(engine.tokenizer, args.context, seed=17), params)
            per_full = probe.cache.device_bytes()
            await engine.delete_session(probe.id)
            engine.memory_account.budget = int(2.5 * per_full)
            result["device_budget"] = engine.memory_account.budget
            result["device_budget_rule"] = "2.5 x the measured device bytes of one full session"
        for mode in modes:
            engine.memory_account.peak = 0
            with progress(args.max_sessions, f"capacity {mode}", quiet=args.quiet, unit="session") as bar:

                def admitted(n: int, done, bar=bar) -> None:
                    bar.set_postfix_str(f"{n} admitted, {engine.memory_account.current / 2**20:.0f} MiB on the device")
                    bar.update()

                figures = await fill(engine, mode, args.context, args.budget, params, args.max_sessions,
                                     on_session=admitted)
            figures["peak_device_bytes"] = engine.memory_account.peak
            figures["capped"] = figures["sessions"] >= args.max_sessions
            for sid in figures.pop("ids"):
                await engine.delete_session(sid)
            result["modes"][mode] = figures
            write_json(result, args.json_out, quiet=True)
        counts = {m: r["sessions"] for m, r in result["modes"].items()}
        if counts.get("tiered"):
            result["tiered_vs"] = {m: round(counts["tiered"] / n, 2) for m, n in counts.items() if m != "tiered" and n}
        result["engine_stats"] = engine.stats()
    finally:
        engine.close()
    return result


def main(args) -> int:
    return run_async(run, args)
