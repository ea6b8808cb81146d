"""``rocketkv-mt bench hsa``: one layer's HSA decode step per CPU backend, on synthetic tensors.

The shapes default to the bundled model's (3 KV heads, 3 query heads each, head dim 64) and the
budget split of an 8k context at budget 256 (1442 kept tokens, pages of 3, top-r 34, topk 128).
Backends alternate in rounds on one thread; the figure is the median per call. Dense attention over
the same kept tokens and over the whole context is timed beside them for scale.
"""
from __future__ import annotations

import statistics
import time

import torch

from bench.common import write_json
from rocketkv_mt import dispatch
from rocketkv_mt.attention_ops import dense_attention
from rocketkv_mt.cache.store import LayerKV
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
    write_json(result, args.json_out)
    return 0
