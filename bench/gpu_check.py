"""The GPU check: one prepared run of everything that needs a GPU, under 8 minutes on one H200.

    python -m bench.gpu_check [--out results/gpu] [--contexts 32k,128k] [--batches 1,8] [--redis-url URL]
                              [--budget-s 450] [--quick] [--estimate]

On a lent machine it runs as ``bash bench/gpu_run.sh`` with the bundle of ``make gpu-bundle``
carried (README: GPU check): the image's Python and torch, a few wheels, no network. So it and what
it imports need no ray, fastapi, uvicorn, websockets or gguf, and every model it loads is built here
with random weights (tests/engine/test_gpu_rehearsal.py holds it to that).

Parts, most important first, each written to ``OUT/<part>.json`` as soon as it ends (a later part
failing or running out of time loses nothing before it; e2e is rewritten after each context), then
``OUT/summary.json`` and a printed summary:

1. ``e2e``: ``bench e2e`` at the given contexts and batches, full against rocketkv and tiered, on a
   random-weight Llama-3.1-8B in bf16;
2. ``prefill_peak``: ``bench prefill-peak`` at the longest context on the same shapes: the session's
   device peak while a first turn of ``full``, ``rocketkv`` and ``tiered`` is fed layer by layer (as
   the engine feeds it: flash attention per group of rows, no score matrix), beside its admission
   bound and the allocator's peak with the prefill's scratch;
3. ``kernel_tests``: the Triton kernel tests compiled for CUDA (``TRITON_INTERPRET=0``, not the
   interpreter), in a subprocess: tests/algorithm/test_kernels.py, test_prefill_attention.py,
   test_decode_batch.py (``-m kernel``);
4. ``tiered_redis``: a 3-turn conversation of a tiered session on a random-weight model of the
   bundled SmolLM2-135M's shapes (the byte tokenizer of ``bench.byte_tokenizer``) on this device,
   persisted to Redis after every turn (a private ``redis-server`` or ``valkey-server`` on a free
   port when none answers at ``--redis-url``; skipped, with the reason, when neither is possible);
5. ``turn_profile``: ``bench turn-profile`` at the shortest e2e context (32k) on its shapes: a short
   second turn of ``rocketkv`` and ``tiered``, timed, then again under cProfile: the host's time by
   function;
6. ``h2d``: host-to-device copy bandwidth from pinned memory (the host tier's pool) and, for
   comparison, from pageable memory;
7. ``ops``: ``bench ops`` on this device: torch ops and kernel launches per decode step per layer at
   1, 4 and 16 sessions, batched and per session.

A part is not started once its estimate (``bench.gpu_estimate``) no longer fits in ``--budget-s``:
it is recorded as skipped, and the run ends inside the lease with its summary written. Without CUDA
the CUDA-only parts are recorded as skipped; ``--quick`` shrinks the rest to tiny shapes (the CPU
tests of this script run that way).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import redis
import torch

from app.engine.engine import Engine
from app.engine.sampling import SamplingParams
from app.settings import Settings
from bench import decode_ops, gpu_estimate, prefill_peak
from bench import e2e as bench_e2e
from bench import turn_profile as bench_turn_profile
from bench.common import fit_words, write_json
from bench.haystack import filler_text
from bench.random_model import SMOLLM2_135M, parse_shapes, random_chat_model

ROOT = Path(__file__).resolve().parent.parent
KERNEL_TESTS = ["tests/algorithm/test_kernels.py", "tests/algorithm/test_prefill_attention.py",
                "tests/algorithm/test_decode_batch.py"]
GIB = 1024**3


class _NoTime(Exception):
    """A part not started: its estimate no longer fits in the check's time budget."""


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(ROOT / "results" / "gpu"), help="folder of the JSON results")
    p.add_argument("--contexts", default="32k,128k", help="bench e2e contexts")
    p.add_argument("--batches", default="1,8", help="bench e2e batch sizes")
    p.add_argument("--redis-url", default=os.environ.get("RKV_REDIS_URL") or "redis://127.0.0.1:6379/15",
                   help="Redis of the tiered conversation (a private redis-server is started if it does not answer)")
    p.add_argument("--quick", action="store_true", help="tiny shapes and short contexts (what a CPU can run)")
    p.add_argument("--budget-s", type=float, default=450.0,
                   help="start no part whose estimate no longer fits in this many seconds from the start")
    p.add_argument("--estimate", action="store_true", help="print the estimated wall time of each part and exit")
    p.add_argument("--chip", choices=sorted(gpu_estimate.CHIPS), default=None,
                   help="estimate for this chip (default: the one here)")
    return p.parse_args(argv)


def _why(case: ET.Element) -> ET.Element | None:
    """A JUnit test case's failure or error element; None when it passed or was skipped."""
    failure = case.find("failure")
    return failure if failure is not None else case.find("error")


def kernel_tests(args) -> dict:
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA: the kernel tests run interpreted in `make test` instead"}
    env = {**os.environ, "TRITON_INTERPRET": "0", "HF_HUB_OFFLINE": "1"}
    with tempfile.TemporaryDirectory() as folder:  # the JSON keeps what the report says: OUT holds few files
        report = Path(folder) / "kernel_tests.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "kernel",
               f"--junitxml={report}", *KERNEL_TESTS]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        if not report.exists():
            return {"error": "pytest wrote no report", "returncode": proc.returncode,
                    "tail": (proc.stdout + proc.stderr)[-2000:]}
        suite = ET.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    bad = [(case, why) for case in suite.iter("testcase") if (why := _why(case)) is not None]
    # Why the first one failed, so that a failure read from the JSON alone can be acted on.
    first = f"{bad[0][1].get('message', '')}\n{bad[0][1].text or ''}"[-1500:] if bad else None
    return {**counts, "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
            "failed": [f"{c.get('classname')}::{c.get('name')}" for c, _ in bad], "first_failure": first,
            "returncode": proc.returncode, "tail": proc.stdout[-2000:]}


def h2d(args) -> dict:
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA"}
    out = {}
    for nbytes in (64 << 20, 1 << 30):
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        for kind, pinned in (("pinned", True), ("pageable", False)):
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
            host.fill_(1)
            dev.copy_(host, non_blocking=pinned)  # warm-up
            torch.cuda.synchronize()
            times = []
            for _ in range(5):
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                dev.copy_(host, non_blocking=pinned)
                stop.record()
                stop.synchronize()
                times.append(start.elapsed_time(stop) / 1e3)
            out[f"{kind}_{nbytes >> 20}MiB_GBps"] = nbytes / statistics.median(times) / 1e9
            del host
        del dev
    torch.cuda.empty_cache()
    return out


def ops(args) -> dict:
    quick = args.quick or not torch.cuda.is_available()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return decode_ops.run(parse_shapes("tiny,num_hidden_layers=4"), device, ["auto"] if quick else ["auto", "torch"],
                          [1, 4] if quick else [1, 4, 16], prompt=96, budget=32)


def _e2e_args(args, on_gpu: bool | None = None) -> argparse.Namespace:
    """bench e2e's arguments: the given contexts on Llama-3.1-8B shapes on a GPU, tiny ones otherwise."""
    quick = args.quick or not (torch.cuda.is_available() if on_gpu is None else on_gpu)
    return argparse.Namespace(
        contexts="256" if quick else args.contexts, batches="1,2" if quick else args.batches,
        modes="full,rocketkv,tiered", shapes="tiny,num_hidden_layers=3" if quick else "llama-3.1-8b",
        device=None, budget=32 if quick else 256, max_new=32 if quick else 128, steps=2 if quick else 10,
        rounds=2, warmup=1 if quick else 2, second_turn=8 if quick else 32, rows=64 if quick else 4096, json_out=None,
    )


def e2e(args) -> dict:
    partial = str(Path(args.out) / "e2e.json")
    return bench_e2e.Bench(_e2e_args(args)).run(on_context=lambda so_far: write_json(so_far, partial, quiet=True))


def _peak_args(args, on_gpu: bool | None = None) -> argparse.Namespace:
    """bench prefill-peak's arguments: the longest e2e context on its shapes, 4096-row groups on a GPU."""
    ns = _e2e_args(args, on_gpu)
    return argparse.Namespace(context=max(bench_e2e.parse_tokens(ns.contexts)), budget=ns.budget, modes=ns.modes,
                              model=None, shapes=ns.shapes, device=None, rows=ns.rows, max_tokens=ns.max_new,
                              json_out=None)


def prefill_peaks(args) -> dict:
    # Written after each mode, so a mode that fails keeps the ones measured before it.
    return prefill_peak.run(argparse.Namespace(**{**vars(_peak_args(args)),
                                                  "json_out": str(Path(args.out) / "prefill_peak.json")}))


def estimates(args) -> dict:
    """Seconds each part should take (``bench.gpu_estimate``) on ``--chip``, else on this device; all
    0 for a quick run or without CUDA. With ``--estimate``, e2e's pieces are given too."""
    chip = args.chip or ("h100" if torch.cuda.is_available() and "h100" in torch.cuda.get_device_name().lower()
                         else "h200" if torch.cuda.is_available() else None)
    if args.quick or chip is None:
        return {name: 0.0 for name in PARTS}
    ns = _e2e_args(args, on_gpu=True)
    e2e_parts = gpu_estimate.e2e_s(parse_shapes(ns.shapes), bench_e2e.parse_tokens(ns.contexts),
                                   [int(b) for b in ns.batches.split(",")], ns.modes.split(","), ns.budget, ns.steps,
                                   ns.rounds, ns.warmup, gpu_estimate.CHIPS[chip])
    peak = _peak_args(args, on_gpu=True)
    peak_s = gpu_estimate.first_turns_s(parse_shapes(peak.shapes), peak.context, len(peak.modes.split(",")),
                                        gpu_estimate.CHIPS[chip])
    pieces = {f"  e2e {k}": v for k, v in e2e_parts.items() if k != "total"} if args.estimate else {}
    return {**gpu_estimate.check_s(e2e_parts, peak_s), **pieces}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1).ping())
    except Exception:  # noqa: BLE001 - any failure means no Redis there
        return False


@contextlib.contextmanager
def _redis(url: str):
    """``url`` when a Redis answers there, else a private server for the duration (``redis-server``,
    or the ``valkey-server`` that ``make gpu-bundle`` carries to a lent machine); None if neither."""
    if _answers(url):
        yield url
        return
    binary = os.environ.get("RKV_REDIS_SERVER") or shutil.which("redis-server") or shutil.which("valkey-server")
    if binary is None:
        yield None
        return
    port = _free_port()
    with tempfile.TemporaryDirectory() as folder:
        proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                                 "--dir", folder], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            private = f"redis://127.0.0.1:{port}/0"
            deadline = time.monotonic() + 20
            while not _answers(private):
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the private redis-server did not start")
                time.sleep(0.05)
            yield private
        finally:
            proc.terminate()
            proc.wait(timeout=20)


async def _converse(engine: Engine, session_id: str, messages: list[str], max_tokens: int) -> list[dict]:
    turns = []
    for text in messages:
        done = await engine.complete(session_id, text, SamplingParams(max_tokens=max_tokens))
        # As the service does after every turn: the KV goes to Redis, so any replica can restore it.
        await engine.persist(session_id)
        m, stored = done.memory, engine.memory(engine.get_session(session_id))
        turns.append({
            "finish_reason": done.finish_reason, "ttft_ms": done.ttft_ms, "latency_ms": done.latency_ms,
            "prefilled_tokens": done.usage.prefilled_tokens, "generated_tokens": done.usage.generated_tokens,
            "device_bytes": m.device_bytes, "host_bytes": m.host_bytes, "redis_bytes": stored.redis_bytes,
            "readmitted_tokens": m.readmitted_tokens, "cold_bytes_read": m.cold_bytes_read,
            "redis_bytes_written": stored.redis_bytes_written,
        })
    return turns


def turn_profile(args) -> dict:
    """A later turn's host time by function, ``rocketkv`` against ``tiered``, at the shortest e2e
    context on its shapes (32k on a GPU)."""
    ns = _e2e_args(args)
    return bench_turn_profile.run(argparse.Namespace(
        context=min(bench_e2e.parse_tokens(ns.contexts)), modes="rocketkv,tiered", shapes=ns.shapes, device=None,
        budget=ns.budget, max_new=ns.max_new, second_turn=ns.second_turn, rows=ns.rows,
        json_out=str(Path(args.out) / "turn_profile.json")))


def tiered_redis(args) -> dict:
    with _redis(args.redis_url) as url:
        if url is None:
            return {"skipped": f"no Redis at {args.redis_url} and no redis-server or valkey-server to start"}
        settings = Settings(redis_url=url, redis_namespace=f"gpucheck{os.getpid()}", mode="tiered")
        device = "cuda" if torch.cuda.is_available() else "cpu"
        shapes = {**SMOLLM2_135M, "num_hidden_layers": 4} if args.quick else SMOLLM2_135M
        loaded = random_chat_model(shapes, device, torch.bfloat16 if device == "cuda" else torch.float32, 16384)
        engine = Engine(settings, loaded=loaded)
        try:
            tokens = 400 if args.quick else 6000  # one byte a token: filler of that many words is long enough
            first = fit_words(engine.tokenizer, filler_text(tokens, seed=3), tokens) + "\n\nWhat is this text about?"
            messages = [first, "Name one thing the text says about the sky.", "Say that again in other words."]
            session = engine.create_session(mode="tiered", budget=64)
            turns = asyncio.run(_converse(engine, session.id, messages, 8 if args.quick else 24))
            stored = engine.redis.session_bytes(session.id)
            asyncio.run(engine.delete_session(session.id))
            return {"device": str(engine.runner.device), "redis": "shared" if url == args.redis_url else "private",
                    "model": f"random weights, shapes {shapes}, byte tokenizer", "turns": turns,
                    "redis_session_bytes_after_turn_3": stored}
        finally:
            engine.close()


# Most important first: a run cut short keeps the headline figures.
PARTS = {"e2e": e2e, "prefill_peak": prefill_peaks, "kernel_tests": kernel_tests, "tiered_redis": tiered_redis,
         "turn_profile": turn_profile, "h2d": h2d, "ops": ops}


def summary_lines(summary: dict) -> list[str]:
    lines = []
    for name, part in summary["parts"].items():
        head = f"{name:13s} {part['wall_s']:7.1f} s  "
        if "error" in part:
            lines.append(head + f"ERROR {part['error']}")
        elif "skipped" in part:
            lines.append(head + f"skipped: {part['skipped']}")
        else:
            lines.append(head + part.get("headline", "ok"))
    lines.append(f"total         {summary['wall_s']:7.1f} s")
    return lines


def _headline(name: str, result: dict) -> str:
    if name == "kernel_tests":
        return f"{result['passed']}/{result['tests']} passed" + (f"; FAILED {result['failed']}" if result["failed"] else "")
    if name == "h2d":
        return ", ".join(f"{k} {v:.1f}" for k, v in result.items())
    if name == "ops":
        return "; ".join(
            f"{kernels}: " + ", ".join(f"{r['sessions']}: {r['ops_per_layer']:.0f} ops {r['launches_per_layer']:.0f} launches"
                                       for r in rows)
            for kernels, rows in result["counts"].items()
        ) + " per layer"
    if name == "e2e":
        return "; ".join(f"{mode} {', '.join(f'{k}: {v:.2f}x' for k, v in by.items())}" for mode, by in result["speedups"].items())
    if name == "prefill_peak":
        return f"{result['context']} tokens: " + ", ".join(
            f"{mode} {r['peak_session_bytes'] / GIB:.2f} GiB (bound {r['admission_bound_bytes'] / GIB:.2f}, "
            f"with scratch {r['peak_with_scratch_bytes'] / GIB:.2f})" for mode, r in result["modes"].items())
    if name == "turn_profile":
        return "second turn: " + ", ".join(f"{mode} {m['ttft_second_turn_ms']:.1f} ms ({m['python_calls']} Python calls)"
                                           for mode, m in result["modes"].items())
    ttft = ", ".join(f"{t['ttft_ms']:.0f}" for t in result["turns"])
    return f"3 turns, TTFT {ttft} ms, Redis {result['redis_session_bytes_after_turn_3'] / 1e6:.2f} MB"


def _nvidia_smi() -> str | None:
    """The driver's view of the machine, kept in the summary: a lent machine sends back at most 8 files."""
    if shutil.which("nvidia-smi") is None:
        return None
    proc = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30)
    return (proc.stdout + proc.stderr)[-4000:]


def main(argv=None) -> int:
    args = _args(argv)
    planned = estimates(args)
    if args.estimate:
        print("\n".join(f"{name:22s} {seconds:7.1f} s" for name, seconds in planned.items()))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    summary = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               "torch": torch.__version__, "nvidia_smi": _nvidia_smi(), "budget_s": args.budget_s,
               "estimates_s": planned, "parts": {}}
    for name, part in PARTS.items():
        start = time.perf_counter()
        left = args.budget_s - (start - t0)
        try:
            if planned[name] > left:
                raise _NoTime(f"no time left: {planned[name]:.0f} s estimated, {max(left, 0):.0f} s of the budget left")
            result = part(args)
            write_json(result, str(out / f"{name}.json"), quiet=True)
            # A part skipped as a whole says why in words; the kernel tests' "skipped" is a count.
            entry = ({"skipped": result["skipped"]} if isinstance(result.get("skipped"), str) else
                     {"error": result["error"]} if "error" in result else {"headline": _headline(name, result)})
        except _NoTime as exc:
            entry = {"skipped": str(exc)}
        except Exception as exc:  # noqa: BLE001 - one part failing must not lose the others
            entry = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        finally:
            bench_e2e.free_memory(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        entry["wall_s"] = time.perf_counter() - start
        summary["parts"][name] = entry
        print(summary_lines({"parts": {name: entry}, "wall_s": time.perf_counter() - t0})[0], flush=True)
    summary["wall_s"] = time.perf_counter() - t0
    write_json(summary, str(out / "summary.json"), quiet=True)
    print("\n".join(["", f"gpu-check summary ({out})", *summary_lines(summary)]))
    failed = any("error" in p for p in summary["parts"].values())
    kernel = summary["parts"]["kernel_tests"]
    return 1 if failed or ("headline" in kernel and "FAILED" in kernel["headline"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
