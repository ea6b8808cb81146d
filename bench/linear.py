"""``rocketkv-mt bench linear``: a float32 linear layer's product on the CPU through ``nn.Linear``
(torch's BLAS) and through oneDNN's packed product (``app.cpu_linear``), rows by rows, alternating.

The shapes default to the bundled model's (out x in): attention q/o, k/v, MLP gate/up and down, the
LM head. Figures: the median microseconds of a call over rounds, the ratio, and GFLOPS.
"""
from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from app import cpu_linear
from bench.common import write_json


def _us(layer: nn.Module, x: torch.Tensor, calls: int) -> float:
    layer(x)
    t0 = time.perf_counter()
    for _ in range(calls):
        layer(x)
    return (time.perf_counter() - t0) / calls * 1e6


def main(args) -> int:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if not cpu_linear.available(torch.device("cpu"), torch.float32):
        raise SystemExit("oneDNN's packed product is not available in this torch build")
    rows_list = [int(r) for r in args.rows.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    out = []
    for n, k in shapes:
        linear = nn.Linear(k, n, bias=False)
        packed = cpu_linear.PackedLinear(linear)
        calls = max(3, int(args.calls * 576 * 576 / (n * k)))
        for rows in rows_list:
            x = torch.randn(rows, k)
            samples = {"torch": [], "onednn": []}
            with torch.inference_mode():
                for _ in range(args.rounds):
                    samples["torch"].append(_us(linear, x, calls))
                    samples["onednn"].append(_us(packed, x, calls))
                diff = (linear(x) - packed(x)).abs().max().item()
            us = {name: statistics.median(v) for name, v in samples.items()}
            out.append({"out": n, "in": k, "rows": rows, "us": {name: round(v, 1) for name, v in us.items()},
                        "gflops": {name: round(2 * n * k * rows / v / 1e3, 1) for name, v in us.items()},
                        "torch_over_onednn": round(us["torch"] / us["onednn"], 2), "max_abs_diff": diff})
    write_json({"threads": args.threads, "rounds": args.rounds, "results": out}, args.json_out)
    return 0
