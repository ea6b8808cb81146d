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
    p.add_argument("--json", dest="json_out", default=None)
    p.set_defaults(func=_run("bench.needle"))


def _run(module: str):
    def run(args: argparse.Namespace) -> int:
        import importlib

        return importlib.import_module(module).main(args)

    return run
