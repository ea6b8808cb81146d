"""``rocketkv-mt bench ...`` subcommands (the benchmarks live in ``bench/``)."""
from __future__ import annotations

import argparse


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)

    p = bench.add_parser("decode", help="decode speed and device KV bytes per mode on one long context")
    p.add_argument("--context", type=int, default=8000)
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--tokens", type=int, default=40, help="decode tokens measured per mode (>= 32)")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds over the modes")
    p.add_argument("--modes", default="full,snapkv,rocketkv")
    p.add_argument("--json", dest="json_out", default=None)
    p.set_defaults(func=_run("bench.decode"))

    p = bench.add_parser("needle", help="single-turn needle-in-a-haystack accuracy per mode")
    p.add_argument("--lengths", default="2000,4000,6000")
    p.add_argument("--cases", type=int, default=4, help="cases per length")
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--modes", default="full,snapkv,rocketkv")
    p.add_argument("--kernel-size", type=int, default=None, help="Stage-1 pooling kernel (default: the server's)")
    p.add_argument("--json", dest="json_out", default=None)
    p.set_defaults(func=_run("bench.needle"))


def add_eval_parser(sub) -> None:
    p = sub.add_parser("eval", help="multi-turn recall accuracy per cache mode on a task file")
    p.add_argument("--tasks", required=True, help="JSONL task file (see bench/tasks/)")
    p.add_argument("--modes", default="full,snapkv,rocketkv,rocketkv-mt,tiered")
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--limit", type=int, default=0, help="only the first N conversations")
    p.add_argument("--prefill-attention", choices=["dense", "selected"], default=None)
    p.add_argument("--details", action="store_true", help="include every reply in the JSON")
    p.add_argument("--json", dest="json_out", default=None)
    p.set_defaults(func=_run("bench.eval_mt"))


def _run(module: str):
    def run(args: argparse.Namespace) -> int:
        import importlib

        return importlib.import_module(module).main(args)

    return run
