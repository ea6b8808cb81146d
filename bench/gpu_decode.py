"""GPU decode attention benchmark at Llama-3.1-8B shapes with random tensors: full KV vs RocketKV kernels.

    python -m bench.gpu_decode --json OUT

Per decode step and layer, ``full`` writes the new token's K/V into a dense bf16 cache and runs torch SDPA
over the whole context; ``rocketkv`` writes it into the kept cache (prompt_budget from the paper's budget
split), tightens the KT min/max of the last page, ranks channels and pages (Triton page scoring, torch
top-k) and runs the Triton sparse decode over the selected pages. Only the attention stack is timed:
q/k/v come from random tensors, no projections, MLP or sampling. Needs only torch and triton.
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from bench.common import write_json
from rocketkv_mt.config import RocketKVConfig

LAYERS, HQ, HKV, HEAD_DIM = 32, 32, 8, 128
G = HQ // HKV
DTYPE = torch.bfloat16
DEVICE = "cuda"
GIB = 1024**3


def _args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.gpu_decode", description=__doc__.split("\n")[0])
    p.add_argument("--json", help="write the results here as JSON")
    p.add_argument("--contexts", default="16384,32768,65536,131072", help="context lengths, comma separated")
    p.add_argument("--batches", default="1,8", help="batch sizes (sessions decoding together)")
    p.add_argument("--budget", type=int, default=256, help="RocketKV token budget")
    p.add_argument("--max-new", type=int, default=128, help="max new tokens, for the budget split")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps (median reported)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--full-kv-cap-gib", type=float, default=80.0,
                   help="above this, full mode allocates one layer's KV and reuses it for all 32 layers")
    return p.parse_args(argv)


def _randn(*shape):
    return torch.empty(*shape, dtype=DTYPE, device=DEVICE).normal_()


class _Inputs:
    """Random q (B, Hkv, G, d) and new k/v (B, Hkv, d) for each layer; the same every step."""

    def __init__(self, batch: int):
        self.q = [_randn(batch, HKV, G, HEAD_DIM) for _ in range(LAYERS)]
        self.k = [_randn(batch, HKV, HEAD_DIM) for _ in range(LAYERS)]
        self.v = [_randn(batch, HKV, HEAD_DIM) for _ in range(LAYERS)]


def _full_step(batch: int, context: int, cap_gib: float):
    """One decode step of dense attention; returns (step fn, notes)."""
    layer_bytes = 2 * batch * HKV * context * HEAD_DIM * DTYPE.itemsize
    n_kv = LAYERS if LAYERS * layer_bytes <= cap_gib * GIB else 1
    caches = [(_randn(batch, HKV, context, HEAD_DIM), _randn(batch, HKV, context, HEAD_DIM)) for _ in range(n_kv)]
    x = _Inputs(batch)
    scaling = HEAD_DIM**-0.5

    def step():
        for layer in range(LAYERS):
            k, v = caches[layer % n_kv]
            k[:, :, context - 1].copy_(x.k[layer])  # the step's own token is the last cache row
            v[:, :, context - 1].copy_(x.v[layer])
            # The group's G query heads become G query rows of their KV head: GQA decode without repeat_kv.
            torch.nn.functional.scaled_dot_product_attention(x.q[layer], k, v, scale=scaling)

    notes = {"kv_layers_allocated": n_kv, "kv_bytes_32_layers": LAYERS * layer_bytes}
    if n_kv == 1:
        notes["note"] = (
            "one layer's KV allocated and reused by all 32 layers (32 layers do not fit); time is 32 x one "
            "layer's attention; peak_mem_modeled adds the 31 missing layers' KV"
        )
    return step, notes, (LAYERS - n_kv) * layer_bytes


def _rocket_step(batch: int, context: int, budget: int, max_new: int):
    from rocketkv_mt import hsa, kernels
    from rocketkv_mt.kt_cache import page_minmax

    split = RocketKVConfig(token_budget=budget).split(context + max_new, max_new, HEAD_DIM)
    ps, length = split.page_size, split.prompt_budget + 1  # kept prompt + the step's own token
    cap = split.prompt_budget + max_new
    pages, cap_pages = -(-length // ps), -(-cap // ps)
    rows = batch * HKV
    layers = []
    for _ in range(LAYERS):
        k, v = _randn(batch, HKV, cap, HEAD_DIM), _randn(batch, HKV, cap, HEAD_DIM)
        kmin = torch.empty(rows, cap_pages, HEAD_DIM, dtype=DTYPE, device=DEVICE)
        kmax = torch.empty_like(kmin)
        kmin[:, :pages], kmax[:, :pages] = page_minmax(k[:, :, :length].flatten(0, 1), ps)
        layers.append((k, v, kmin, kmax))
    x = _Inputs(batch)
    scaling = HEAD_DIM**-0.5
    last_page = (length - 1) // ps

    def step():
        for layer in range(LAYERS):
            k, v, kmin, kmax = layers[layer]
            k_new = x.k[layer]
            k[:, :, length - 1].copy_(k_new)
            v[:, :, length - 1].copy_(x.v[layer])
            flat = k_new.flatten(0, 1)
            torch.minimum(kmin[:, last_page], flat, out=kmin[:, last_page])
            torch.maximum(kmax[:, last_page], flat, out=kmax[:, last_page])
            q = x.q[layer]
            qf = q.flatten(0, 1)
            channels = hsa.select_channels(qf, split.topr)
            scores = kernels.page_scores(qf, kmin[:, :pages], kmax[:, :pages], channels)
            chosen = hsa.select_pages(scores, split.topk_pages)
            tokens, valid = hsa.page_tokens(chosen, ps, length)
            kernels.sparse_attention_batched(
                q, k[:, :, :length], v[:, :, :length],
                tokens.view(batch, HKV, -1), valid.view(batch, HKV, -1), scaling,
            )

    kv_bytes = LAYERS * (2 * batch * HKV * cap * HEAD_DIM + 2 * rows * cap_pages * HEAD_DIM) * DTYPE.itemsize
    notes = {
        "split": {"prompt_budget": split.prompt_budget, "page_size": ps, "topr": split.topr,
                  "topk_tokens": split.topk, "topk_pages": split.topk_pages, "pages": pages},
        "kv_layers_allocated": LAYERS,
        "kv_bytes_32_layers": kv_bytes,
    }
    return step, notes, 0


def _time(step, warmup: int, steps: int) -> dict:
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    eager = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        eager.append((time.perf_counter() - t0) * 1e3)
    out = {"ms_per_token_eager": statistics.median(eager)}
    # CUDA graphs remove launch overhead (~100-400 launches per step), as production servers do.
    try:
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            step()
        graph.replay()
        replays = []
        for _ in range(steps):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            stop.record()
            stop.synchronize()
            replays.append(start.elapsed_time(stop))
        out["ms_per_token_graph"] = statistics.median(replays)
        del graph
    except Exception as exc:  # noqa: BLE001 - a capture failure must not lose the eager numbers
        out["graph_error"] = f"{type(exc).__name__}: {exc}"
    return out


def _run_config(mode: str, batch: int, context: int, args) -> dict:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    if mode == "full":
        step, notes, missing = _full_step(batch, context, args.full_kv_cap_gib)
    else:
        step, notes, missing = _rocket_step(batch, context, args.budget, args.max_new)
    row = {"mode": mode, "context": context, "batch": batch, **_time(step, args.warmup, args.steps)}
    peak = torch.cuda.max_memory_allocated()
    row["peak_mem_gib"] = peak / GIB
    row["peak_mem_modeled_gib"] = (peak + missing) / GIB
    row.update(notes)
    row["wall_s"] = time.perf_counter() - t0
    del step
    return row


def main(argv=None) -> int:
    args = _args(argv)
    if not torch.cuda.is_available():
        print("bench.gpu_decode: no CUDA device; nothing to measure (skipped)")
        if args.json:
            write_json({"skipped": "no CUDA"}, args.json)
        return 0
    torch.manual_seed(0)
    contexts = [int(c) for c in args.contexts.split(",") if c]
    batches = [int(b) for b in args.batches.split(",") if b]
    rows = []
    for context in contexts:
        for batch in batches:
            for mode in ("full", "rocketkv"):
                try:
                    row = _run_config(mode, batch, context, args)
                except torch.cuda.OutOfMemoryError as exc:  # record it and go on with the other configs
                    row = {"mode": mode, "context": context, "batch": batch, "error": f"OOM: {exc}"[:300]}
                    torch.cuda.empty_cache()
                rows.append(row)
                print(f"{mode:9s} ctx={context:6d} B={batch}: "
                      f"{row.get('ms_per_token_eager', math.nan):.2f} ms eager, "
                      f"{row.get('ms_per_token_graph', math.nan):.2f} ms graph, "
                      f"peak {row.get('peak_mem_gib', math.nan):.1f} GiB", flush=True)
    speedup = {}
    for full, rocket in zip(rows[0::2], rows[1::2]):
        key = f"ctx{full['context']}_b{full['batch']}"
        timed = [k for k in ("ms_per_token_eager", "ms_per_token_graph") if k in full and k in rocket]
        speedup[key] = {k: full[k] / rocket[k] for k in timed}
    write_json({
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shapes": {"layers": LAYERS, "q_heads": HQ, "kv_heads": HKV, "head_dim": HEAD_DIM, "dtype": "bfloat16"},
        "token_budget": args.budget,
        "max_new": args.max_new,
        "steps": args.steps,
        "notes": [
            "attention stack only (random q/k/v per layer; no projections, MLP, sampling): "
            "end-to-end speed-ups are smaller",
            "full: SDPA with each KV head's G query heads folded into G query rows (GQA without repeat_kv)",
            "ms_per_token_eager: median wall time of a synchronized step; "
            "ms_per_token_graph: median CUDA-event time of one CUDA-graph replay of the step",
            "each step rewrites the same last cache row, so the context length is constant over the timed steps",
            "peak_mem_gib: torch.cuda.max_memory_allocated during the config (decode only; prefill not modeled)",
            "rocketkv keeps prompt_budget tokens per KV head (+ max_new headroom) and their KT min/max pages; "
            "all 32 layers allocated",
        ],
        "results": rows,
        "speedup_full_over_rocketkv": speedup,
    }, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
