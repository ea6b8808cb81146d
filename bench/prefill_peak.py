"""``rocketkv-mt bench prefill-peak``: what a long first turn holds on the device while it is
prefilled, per cache mode, fed as the engine feeds it (layer by layer, ``app.engine.layer_prefill``).

For each mode a fresh cache takes one prompt of ``--context`` tokens, one group of rows at a time;
after every group the cache's ``device_bytes()`` (session KV, KT and what its policies hold) is read.
Reported per mode, beside each other:

- ``peak_session_bytes``: the most the session's cache held at any group boundary (measured);
- ``admission_bound_bytes``: what the engine reserves for that turn (``DeviceMemory.turn_bound`` with
  the engine's prefill chunk): the peak must stay within it;
- ``scratch_bytes``: what the prefill holds besides the cache: on CUDA measured (the allocator's peak
  over the prefill, less the cache's own peak and what was allocated before); on a CPU computed from
  the shapes: the prompt's hidden states and rotary tables (``LayerPrefill.scratch_bytes``), one
  group's MLP activations and its attention workspace (``attention_ops.prefill_scratch_bytes``);
- ``peak_with_scratch_bytes``: the two together;
- ``held_after_bytes``: the session's bytes once the prefill ended.

The model is the bundled one (``--model`` for another, e.g. ``qwen2.5-coder-0.5b``), or with
``--shapes`` a random-weight model of those shapes (``bench.random_model``; the GPU check runs
Llama-3.1-8B's at 128k): byte figures depend on the shapes, not the weights.
"""
from __future__ import annotations

import time

import torch

from app.engine.layer_prefill import LayerPrefill
from app.engine.memory import DeviceMemory
from app.engine.model_runner import ModelRunner
from app.engine.session import Session
from app.model_loader import load_model
from app.settings import Settings
from bench.common import write_json
from bench.random_model import parse_shapes, random_model
from rocketkv_mt.attention_ops import prefill_scratch_bytes
from rocketkv_mt.cache import TierContext, TierPolicy, make_cache
from rocketkv_mt.config import RocketKVConfig
from tiers.host.tier import HostTier

GIB = 1024**3


def _scratch_computed(plan: LayerPrefill, config, spec, rows: int, n: int) -> int:
    """A CPU prefill's scratch from the shapes: carried states, one group's MLP and attention."""
    elem = torch.empty((), dtype=spec.dtype).element_size()
    mlp = 3 * rows * config.intermediate_size * elem + 2 * rows * config.hidden_size * elem
    attention = prefill_scratch_bytes(rows, n, config.num_attention_heads, spec.num_kv_heads, spec.head_dim,
                                      spec.dtype, spec.device)
    return plan.scratch_bytes() + mlp + attention


def measure(model, runner: ModelRunner, mode: str, ids: list[int], rocket: RocketKVConfig, rows: int,
            tiers: TierPolicy, max_new: int) -> dict:
    """One first turn of ``mode`` fed layer by layer: its peaks, bound and scratch."""
    spec, device = runner.spec, runner.spec.device
    memory = DeviceMemory(0, spec, tiers)
    cache = make_cache(mode, spec, rocket, TierContext(HostTier(4 * GIB if device.type == "cpu" else 64 * GIB),
                                                       f"peak-{mode}", tiers))
    session = Session(id=f"peak-{mode}", mode=mode, rocket=rocket, cache=cache)
    bound = memory.turn_bound(session, len(ids), max_new, prefill_chunk=rows)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    plan = LayerPrefill(model, cache, ids, max_new, rows)
    peak, scratch = 0, 0
    while not plan.done:
        plan.feed_group()
        peak = max(peak, cache.device_bytes())
        if not cuda:
            scratch = max(scratch, _scratch_computed(plan, model.config, spec, rows, len(ids)))
    plan.finish()
    if cuda:
        torch.cuda.synchronize(device)
        scratch = torch.cuda.max_memory_allocated(device) - base - peak
    out = {
        "peak_session_bytes": peak, "admission_bound_bytes": bound, "scratch_bytes": scratch,
        "scratch": "measured (CUDA allocator peak)" if cuda else "computed from the shapes",
        "peak_with_scratch_bytes": peak + scratch, "held_after_bytes": cache.device_bytes(),
        "kept_tokens": cache.kept_tokens(), "host_bytes": cache.tier_bytes()["host"],
        "prefill_s": round(time.perf_counter() - t0, 2),
    }
    cache.release()
    return out


def run(args) -> dict:
    settings = Settings(**({"model": args.model} if args.model else {}))
    if args.shapes:
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        loaded = random_model(parse_shapes(args.shapes), device, torch.bfloat16 if device == "cuda" else torch.float32,
                              max_positions=args.context + 64)
    else:
        loaded = load_model(settings)
    runner = ModelRunner(loaded)
    vocab = loaded.model.config.vocab_size
    ids = torch.randint(0, vocab, (args.context,), generator=torch.Generator().manual_seed(0)).tolist()
    rocket = RocketKVConfig(token_budget=args.budget)
    tiers = TierPolicy(page_tokens=settings.page_tokens)
    rows = args.rows or settings.prefill_chunk
    result = {"context": args.context, "token_budget": args.budget, "rows_per_group": rows,
              "model": args.shapes or settings.model, "device": str(runner.device), "dtype": str(loaded.dtype),
              "method": "a first turn fed layer by layer, one group of rows at a time; the session's device_bytes() "
              "read after every group", "modes": {}}
    for mode in [m for m in args.modes.split(",") if m]:
        result["modes"][mode] = row = measure(loaded.model, runner, mode, ids, rocket, rows, tiers, args.max_tokens)
        print(f"{mode:12s} peak {row['peak_session_bytes'] / 2**20:9.1f} MiB  bound {row['admission_bound_bytes'] / 2**20:9.1f}"
              f" MiB  with scratch {row['peak_with_scratch_bytes'] / 2**20:9.1f} MiB  after {row['held_after_bytes'] / 2**20:8.1f}"
              f" MiB  ({row['prefill_s']} s)", flush=True)
        write_json(result, args.json_out, quiet=True)
    full = result["modes"].get("full", {}).get("peak_session_bytes")
    if full:
        result["peak_over_full"] = {m: round(r["peak_session_bytes"] / full, 4) for m, r in result["modes"].items()}
    write_json(result, args.json_out, quiet=True)
    return result


def main(args) -> int:
    run(args)
    return 0
