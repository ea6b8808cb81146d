"""``rocketkv-mt bench hsa``: one layer's HSA decode step per CPU backend, on synthetic tensors.

The shapes default to the bundled model's (3 KV heads, 3 query heads each, head dim 64) and the
budget split of an 8k context at budget 256 (1442 kept tokens, pages of 3, top-r 34, topk 128).
Backends alternate in rounds on one thread; the figure is the median per call. Dense attention over
the same kept tokens and over the whole context is timed beside them for scale. ``--sessions S`` also
times the native batched call of a decode step of S sessions over ``--layers`` layers, every session
and layer with buffers of its own (as in a model's step, where each is cold when its turn comes): the
figure is per session and layer.
"""
from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from bench.common import write_json
from rocketkv_mt import dispatch
from rocketkv_mt.attention_ops import dense_attention
from rocketkv_mt.cache.decode_target import DecodeTarget
from rocketkv_mt.cache.store import LayerKV
from rocketkv_mt.config import BudgetSplit
from rocketkv_mt.kt_cache import KTCache
from rocketkv_mt.native import hsa as native_hsa


def _layer(hkv: int, d: int, length: int) -> LayerKV:
    store = LayerKV(hkv, d, torch.float32, torch.device("cpu"))
    store.append(torch.randn(hkv, length, d), torch.randn(hkv, length, d), torch.arange(length))
    return store


def _median_us(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def main(args) -> int:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    hkv, g, d = args.kv_heads, args.group, args.head_dim
    kept, context = _layer(hkv, d, args.kept), _layer(hkv, d, args.context)
    kt = KTCache(kept.keys, args.page_size)
    key_buf, value_buf = kept.buffers
    q = torch.randn(hkv, g, d)
    scaling = d ** -0.5

    def hsa(backend):
        return lambda: dispatch.hsa_decode(
            q, key_buf, value_buf, kept.length, kt.bounds, args.page_size, args.topr, args.topk, scaling,
            local_window=args.local_window, backend=backend,
        )

    q_dense = q.reshape(hkv * g, 1, d)
    calls = {
        "native": hsa("native"),
        "torch": hsa("torch"),
        "dense_kept": lambda: dense_attention(q_dense, kept.keys, kept.values, scaling),
        "dense_context": lambda: dense_attention(q_dense, context.keys, context.values, scaling),
    }
    if not native_hsa.supports(q):
        calls.pop("native")
    for fn in calls.values():
        fn()  # warm up (and build the native kernel)
    samples = {name: [] for name in calls}
    for _ in range(args.rounds):
        for name, fn in calls.items():
            samples[name].append(_median_us(fn, args.calls))
    us = {name: round(statistics.median(v), 1) for name, v in samples.items()}
    result = {
        "shapes": {"kv_heads": hkv, "group": g, "head_dim": d, "kept": args.kept, "context": args.context,
                   "page_size": args.page_size, "topr": args.topr, "topk": args.topk, "local_window": args.local_window},
        "us_per_call": us,
        "ratios": {f"{a}/{b}": round(us[a] / us[b], 2) for a in us for b in ("native",) if b in us and a != b},
    }
    if args.sessions and native_hsa.supports(q):
        result["batched"] = _batched(args, scaling)
    write_json(result, args.json_out)
    return 0


def _batched(args, scaling: float) -> dict:
    """The native batched step of ``args.sessions`` sessions, ``args.layers`` layers in turn, each with its
    own kept set and KT bounds: microseconds per session and layer (median over rounds of whole steps).
    The token each call appends goes to the same free row every time (the targets are never committed)."""
    hkv, g, d, n = args.kv_heads, args.group, args.head_dim, args.sessions
    split = BudgetSplit(token_budget=args.kept, window_size=32, kernel_size=63, prompt_budget=args.kept,
                        page_size=args.page_size, topr=args.topr, topk=args.topk, local_window=args.local_window)
    layers, held = [], []  # held: the targets whose buffers the rows point into
    for _ in range(args.layers):
        targets = []
        for _ in range(n):
            store = _layer(hkv, d, args.kept)
            targets.append(DecodeTarget(store, kt=KTCache(store.keys, args.page_size), split=split))
        layers.append(np.asarray([t.row(args.kept) for t in targets], dtype=np.int64))
        held.append(targets)
    q, k_new, v_new = torch.randn(n, hkv, g, d), torch.randn(n, hkv, d), torch.randn(n, hkv, d)
    steps = []
    for _ in range(args.rounds + 1):
        t0 = time.perf_counter()
        for table in layers:
            native_hsa.decode_batch(table, q, k_new, v_new, scaling)
        steps.append(time.perf_counter() - t0)
    step = statistics.median(steps[1:])  # the first builds and warms the kernel
    return {"sessions": n, "layers": args.layers, "step_ms": round(step * 1e3, 2),
            "us_per_session_layer": round(step * 1e6 / (n * args.layers), 1)}
