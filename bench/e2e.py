"""``rocketkv-mt bench e2e``: the whole model, end to end, at long contexts: full against RocketKV.

A random-weight model of a real model's shapes (``bench.random_model``: Llama-3.1-8B by default,
bf16 on CUDA) prefills a context of random tokens in each mode; then, per batch size, that many
sessions decode together (the prefilled one and copies of it: a copy's KV is the same size and
costs the same to read, without prefilling the context again), modes alternating step blocks in
rounds, every step a batched ``ModelRunner.step`` plus the sampling of its tokens. Reported per
context, mode and batch: decode ms per step (per token of each session), the sessions' device
bytes (KV and KT) and the device's peak allocation; per context and mode, the prefill time and the
time to first token of a short second turn on top of the prefilled context and its reply.

A context longer than ``--rows`` is prefilled as the engine feeds a long first prompt (``by_layer``):
layer by layer, each over the whole prompt in groups of ``--rows`` query rows
(``app.engine.layer_prefill``), so no activation of the whole prompt is held at once (a whole-prompt
forward at 128k would need several GiB per MLP activation on Llama-3.1-8B's shapes).

Modes: ``full`` decodes densely with SDPA per session (flash or memory-efficient attention, GQA
folded into rows); ``full-batched`` is the same cache through the batched decode kernel's dense
path; ``rocketkv``, ``rocketkv-mt``, ``snapkv`` and ``tiered`` run as the engine runs them. A
batch whose copies would not fit in the device's free memory is recorded as skipped with the bytes
it needs.
"""
from __future__ import annotations

import copy
import gc
import statistics
import time

import torch

from app.engine.layer_prefill import LayerPrefill
from app.engine.model_runner import ModelRunner, Segment
from app.engine.sampling import plain_sampler, sample_batch
from app.engine.steps import by_layer
from bench.common import write_json
from bench.random_model import parse_shapes, random_model
from rocketkv_mt.cache import SessionCache, TierContext, make_cache
from rocketkv_mt.config import RocketKVConfig
from tiers.host.tier import HostTier
from tiers.transfers import Transfers

# Bench mode -> (cache mode, kernels setting of its runner).
MODES = {
    "full": ("full", "torch"),
    "full-batched": ("full", "auto"),
    "snapkv": ("snapkv", "auto"),
    "rocketkv": ("rocketkv", "auto"),
    "rocketkv-mt": ("rocketkv-mt", "auto"),
    "tiered": ("tiered", "auto"),
}
GIB = 1024**3


def parse_tokens(text: str) -> list[int]:
    """``"32k,128k"`` -> [32768, 131072]; plain numbers are tokens."""
    out = []
    for part in (p.strip().lower() for p in text.split(",") if p.strip()):
        out.append(int(part[:-1]) * 1024 if part.endswith("k") else int(part))
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    """What dropped caches held goes back to the device: a cache and its policies point at each other
    (and a failed run's frames hang off its traceback), so a dropped one lives until the cyclic
    collector runs, crowding the next prefill, the free memory ``fits`` reads and, in the GPU check,
    the parts after it; the allocator's cache would still keep it from another process."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _clone(cache: SessionCache) -> SessionCache:
    """A copy of a prefilled cache for decoding beside it: its device tensors copied, its tiers (host
    pool, Redis, codec) shared, never copied. The copy is only decoded, never released or given a turn."""
    shared = {}
    # The tiers hang off the cache's policies (its prefill policy holds them), not the cache itself.
    owners = [cache, *(v for v in vars(cache).values() if hasattr(v, "__dict__"))]
    for value in (v for owner in owners for v in vars(owner).values()):
        if isinstance(value, TierContext):
            shared.update({id(v): v for v in (value, *vars(value).values())})
    return copy.deepcopy(cache, shared)


class Bench:
    def __init__(self, args):
        self.args = args
        self.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.shapes = parse_shapes(args.shapes)
        self.contexts = parse_tokens(args.contexts)
        self.batches = [int(b) for b in args.batches.split(",") if b]
        self.modes = [m for m in args.modes.split(",") if m]
        unknown = [m for m in self.modes if m not in MODES]
        if unknown:
            raise ValueError(f"unknown bench modes {unknown}; one of {sorted(MODES)}")
        self.max_new = args.max_new
        longest = max(self.contexts) + args.second_turn + self.max_new + 16
        self.loaded = random_model(self.shapes, self.device, self.dtype, max_positions=longest)
        self.runners = {k: ModelRunner(self.loaded, kernels=k) for k in {kernels for _, kernels in MODES.values()}}
        spec = self.runners["auto"].spec
        per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * self.loaded.model.dtype.itemsize
        self.host = HostTier(int(2 * per_token * longest) + (1 << 26))
        # The engine's page reader: a tiered turn reads its next layer's pages on it (a side stream on CUDA).
        self.transfers = Transfers(self.device)
        self.rocket = RocketKVConfig(token_budget=args.budget)
        self.gen = torch.Generator().manual_seed(0)
        self.greedy = plain_sampler()

    def ids(self, n: int) -> list[int]:
        return torch.randint(0, self.shapes["vocab_size"], (n,), generator=self.gen).tolist()

    def new_cache(self, mode: str, sid: str) -> tuple[ModelRunner, SessionCache]:
        cache_mode, kernels = MODES[mode]
        runner = self.runners[kernels]
        tiers = TierContext(self.host, sid, transfers=self.transfers)
        return runner, make_cache(cache_mode, runner.spec, self.rocket, tiers=tiers)

    def step(self, runner: ModelRunner, caches: list[SessionCache], tokens: list[int]) -> list[int]:
        logits, errors = runner.step([Segment(c, [t]) for c, t in zip(caches, tokens)])
        if errors:
            raise RuntimeError(f"decode failed: {next(iter(errors.values()))!r}")
        return sample_batch(logits, [self.greedy] * len(caches))

    def prefill(self, mode: str, context: int, rows: int | None = None) -> dict:
        runner, cache = self.new_cache(mode, f"{mode}-{context}")
        ids = self.ids(context)
        _sync(self.device)
        t0 = time.perf_counter()
        rows = rows or self.args.rows
        if runner.layerable and by_layer(0, len(ids), rows, cache.last_chunk_min() is not None, cache.layers_later()):
            plan = LayerPrefill(runner.model, cache, ids, self.max_new, rows)
            plan.advance()
            logits = plan.finish()
        else:
            logits = runner.forward(ids, cache, prefill=True, max_new=self.max_new)
        token = int(logits.argmax())
        prefill_s = time.perf_counter() - t0  # to the first token, as the engine's time to first token
        # What the prefill left to apply (``tiered`` on a CPU: its last layer, on the page reader) is
        # done before the cache is measured or copied (a copy of a job in flight is no copy).
        cache.settle()
        return {"runner": runner, "cache": cache, "token": token, "prefill_s": prefill_s}

    def second_turn(self, state: dict) -> float:
        """ms from feeding a short second turn to having its first token."""
        ids = self.ids(self.args.second_turn)
        _sync(self.device)
        t0 = time.perf_counter()
        logits = state["runner"].forward(ids, state["cache"], prefill=True, max_new=self.max_new)
        int(logits.argmax())
        return (time.perf_counter() - t0) * 1e3

    def fits(self, cache: SessionCache, copies: int) -> tuple[bool, int]:
        need = copies * cache.device_bytes()
        if self.device.type != "cuda":
            return True, need
        free, _ = torch.cuda.mem_get_info(self.device)
        return need + 4 * GIB < free, need

    def decode(self, states: dict, batch: int) -> dict:
        """Modes alternate blocks of steps over the rounds; the median step per mode."""
        free_memory(self.device)  # the copies of the batch before
        groups, rows = {}, {}
        for mode, state in states.items():
            ok, need = self.fits(state["cache"], batch - 1)
            if not ok:
                rows[mode] = {"skipped": f"{batch} sessions do not fit: {need / GIB:.1f} GiB more needed"}
                continue
            caches = [state["cache"]] + [_clone(state["cache"]) for _ in range(batch - 1)]
            groups[mode] = {"caches": caches, "tokens": [state["token"]] * batch, "ms": []}
        for round_ in range(self.args.rounds):
            for mode, group in groups.items():
                runner = states[mode]["runner"]
                for _ in range(self.args.warmup if round_ == 0 else 0):
                    group["tokens"] = self.step(runner, group["caches"], group["tokens"])
                for _ in range(self.args.steps):
                    _sync(self.device)
                    t0 = time.perf_counter()
                    group["tokens"] = self.step(runner, group["caches"], group["tokens"])
                    group["ms"].append((time.perf_counter() - t0) * 1e3)
        for mode, group in groups.items():
            rows[mode] = {
                "ms_per_step": statistics.median(group["ms"]),
                "tokens_per_s": batch * 1e3 / statistics.median(group["ms"]),
                "device_bytes": sum(c.device_bytes() for c in group["caches"]),
                "steps_timed": len(group["ms"]),
            }
            states[mode]["token"] = group["tokens"][0]
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
            for row in rows.values():
                row.setdefault("device_peak_allocated_bytes", peak)
        return rows

    def context(self, context: int) -> dict:
        free_memory(self.device)  # the context before's sessions and copies
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        states = {mode: self.prefill(mode, context) for mode in self.modes}
        out = {"context": context, "modes": {}}
        for mode, state in states.items():
            out["modes"][mode] = {"prefill_s": state["prefill_s"], "session_device_bytes": state["cache"].device_bytes()}
        out["decode"] = {str(b): self.decode(states, b) for b in self.batches}
        for mode, state in states.items():  # after the decode: the second turn follows a reply
            out["modes"][mode]["ttft_second_turn_ms"] = self.second_turn(state)
            out["modes"][mode]["host_bytes"] = state["cache"].tier_bytes()["host"]
            state["cache"].release()
        return out

    def warm_up(self) -> None:
        """Every mode once at a short context: kernels compile here, not inside a timed step."""
        context = min(2048, min(self.contexts))
        # Each way the timed contexts are prefilled (whole; layer by layer in groups of rows), so
        # that both paths' kernels are built here.
        ways = {context: any(c <= self.args.rows for c in self.contexts),
                max(1, min(self.args.rows, context // 2)): any(c > self.args.rows for c in self.contexts)}
        for rows in (r for r, used in ways.items() if used):
            states = {mode: self.prefill(mode, context, rows) for mode in self.modes}
            for batch in sorted({1, max(self.batches)}):
                for state in states.values():
                    caches = [state["cache"]] + [_clone(state["cache"]) for _ in range(batch - 1)]
                    self.step(state["runner"], caches, [state["token"]] * batch)
            for state in states.values():
                self.second_turn(state)
                state["cache"].release()

    def run(self, on_context=None) -> dict:
        """Every context in turn; ``on_context(partial result)`` after each one (the GPU check writes
        it out, so a run stopped at its time limit keeps the contexts it finished)."""
        self.warm_up()
        results = []
        for context in self.contexts:
            results.append(self.context(context))
            if on_context is not None:
                on_context(self.report(results))
        return self.report(results)

    def report(self, results: list[dict]) -> dict:
        speedup = {}
        for res in results:
            for batch, rows in res["decode"].items():
                full = rows.get("full", {}).get("ms_per_step")
                for mode, row in rows.items():
                    if mode != "full" and full and "ms_per_step" in row:
                        speedup.setdefault(f"{mode}_over_full", {})[f"{res['context']}_b{batch}"] = full / row["ms_per_step"]
        return {
            "device": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "dtype": str(self.dtype).removeprefix("torch."),
            "shapes": self.shapes,
            "token_budget": self.args.budget,
            "max_new": self.max_new,
            "steps": self.args.steps,
            "rounds": self.args.rounds,
            "second_turn_tokens": self.args.second_turn,
            "notes": [
                "random weights and random tokens: costs, not answers",
                "ms_per_step: median wall time of one batched decode step (every session's next token, sampled "
                "on the model thread); per token of each session",
                "batch > 1: copies of the prefilled session decode beside it (same KV size, same reads)",
                "full: SDPA per session (flash or memory-efficient); full-batched: the batched decode kernel",
            ],
            "results": results,
            "speedups": speedup,
        }


def main(args) -> int:
    result = Bench(args).run()
    for res in result["results"]:
        for batch, rows in res["decode"].items():
            for mode, row in rows.items():
                line = row.get("skipped") or f"{row['ms_per_step']:8.2f} ms/step, {row['device_bytes'] / GIB:7.3f} GiB"
                ttft = res["modes"][mode]["ttft_second_turn_ms"]
                print(f"ctx={res['context']:7d} B={batch:>2} {mode:12s} {line}  (2nd-turn TTFT {ttft:8.1f} ms)")
    write_json(result, args.json_out, quiet=True)
    return 0
