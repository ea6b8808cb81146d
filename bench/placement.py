"""``rocketkv-mt bench placement``: refusals, parks, moves and device use per placement policy at 2, 8 and
64 replicas, by simulation (``bench.placement_sim``) of a synthetic chat trace (``bench.placement_trace``,
whose docstring gives its numbers and their sources).

Each replica count gets its own trace, drawn with the same seed at the same load per replica
(``--rate`` conversations a second per replica), and every policy replays that same trace:
``hash`` (rendezvous hashing alone), ``memory`` (the most room, ``RKV_PLACEMENT=memory``) and, with
``--moves``, ``memory+moves`` (a parked ``tiered`` session is placed again at its next turn; simulated
only). Per run: turns refused (``device_memory_exhausted``, after waiting up to ``admission_wait_s``),
turns that waited, sessions parked, re-prefilled tokens (a parked ``full`` session), restores from
Redis, moves, and device use: the fleet's mean held bytes over its budget, and the busiest replica's
mean of the bytes active sessions hold (the room's complement), against the mean replica's.
"""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import asdict, replace

from bench.common import write_json
from bench.placement_sim import SimConfig, Simulation
from bench.placement_trace import TraceShape, synthetic_trace, trace_figures


def summarize(sim: Simulation, wall_s: float) -> dict:
    c = sim.counts
    n = len(sim.replicas)
    held = [h for h, _ in c.samples]
    # The samples cycle through the replicas in order, one round per report.
    per_replica = [statistics.fmean(a for _, a in c.samples[i::n]) for i in range(n)]
    mean_active = statistics.fmean(per_replica)
    return {
        "turns": c.turns,
        "refused": c.refused,
        "refused_share": round(c.refused / max(1, c.turns), 4),
        "waited": c.waited,
        "parks": c.parks,
        "restores": c.restores,
        "reprefills": c.reprefills,
        "reprefill_tokens": c.reprefill_tokens,
        "moves": c.moves,
        "device_held_mean": round(statistics.fmean(held), 3),
        "device_active_mean": round(mean_active, 3),
        "device_active_busiest": round(max(per_replica), 3),
        "wall_s": round(wall_s, 1),
    }


def scenarios(args) -> dict[str, TraceShape]:
    """``chat``: the chat trace at ``--rate`` conversations a second per replica, with its burst. ``burst``:
    a fresh fleet hit at once, every conversation opening with a document of about ``--burst-doc`` tokens,
    half of them in ``full``, short gaps: the case hashing spreads unevenly in bytes."""
    chat = TraceShape(rate=args.rate, duration_s=args.duration, doc_share=args.doc_share, full_share=args.full_share,
                      max_new=args.max_new)
    burst = TraceShape(rate=args.burst_rate, duration_s=args.burst_duration, burst_at=0.0, burst_s=args.burst_duration,
                       burst_factor=1.0, doc_share=1.0, doc_median=args.burst_doc, doc_sigma=0.25, think_median_s=5.0,
                       full_share=0.5, max_new=args.max_new)
    return {name: shape for name, shape in (("chat", chat), ("burst", burst)) if name in args.scenarios.split(",")}


def run_grid(replica_counts: list[int], policies: list[str], shape: TraceShape, base: SimConfig, seed: int,
             quiet: bool = True) -> dict:
    """Per replica count: the trace drawn for it (``shape.rate`` per replica) and each policy's figures."""
    runs: dict[str, dict] = {}
    for n in replica_counts:
        trace = synthetic_trace(replace(shape, rate=shape.rate * n), seed)
        runs[str(n)] = {"trace": trace_figures(trace), "policies": {}}
        for name in policies:
            policy, _, extra = name.partition("+")
            cfg = replace(base, replicas=n, policy=policy, moves=extra == "moves")
            start = time.perf_counter()
            sim = Simulation(cfg, trace)
            sim.run()
            runs[str(n)]["policies"][name] = result = summarize(sim, time.perf_counter() - start)
            if not quiet:
                print(f"{n} replicas, {name}: {result}", file=sys.stderr, flush=True)
    return runs


def main(args) -> int:
    base = SimConfig(replicas=1, device_budget=int(args.device_budget_gib * 1024**3), token_budget=args.budget,
                     admission_wait_s=args.admission_wait)
    policies = [p for p in args.policies.split(",") if p] + (["memory+moves"] if args.moves else [])
    counts = [int(n) for n in args.replicas.split(",")]
    shapes = scenarios(args)
    config = {k: v for k, v in asdict(base).items() if k not in ("replicas", "policy", "moves", "spec")}
    result = {
        "placement": {"sim": config, "model": "llama-3.1-8b shapes, bfloat16", "seed": args.seed,
                      "scenarios": {name: asdict(shape) for name, shape in shapes.items()}},
        "replica_counts": counts,
        "scenarios": {name: run_grid(counts, policies, shape, base, args.seed, args.quiet) for name, shape in shapes.items()},
    }
    write_json(result, args.json_out)
    return 0
