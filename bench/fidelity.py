"""``rocketkv-mt bench fidelity``: how closely a compressed cache follows full attention, token by token.

Each conversation is first answered greedily in ``full`` mode. Every variant (a cache mode plus
RocketKV settings) then reads that same transcript, teacher-forced: the turn's prompt is
prefilled, the reply fed one token at a time. At each reply position the variant's next-token
distribution is compared with full's: top-1 agreement and KL(full || variant). Unlike the
accuracy of ``rocketkv-mt eval``, whose conversations drift apart after the first differing
token, this scores every position on the same history, so small differences between settings
show above the noise. On a terminal a bar counts the transcripts and the variants' runs over them,
with the running agreement (``--quiet``: none).
"""
from __future__ import annotations

import json

import torch

from app.engine.sampling import SamplingParams
from app.progress import progress
from bench.common import Engines, run_async
from bench.eval_mt import load_tasks
from rocketkv_mt.config import RocketKVConfig


async def transcript(engine, task: dict, budget: int, params: SamplingParams) -> tuple[list[int], list[tuple[int, int]]]:
    """Full mode's greedy conversation: its token ids and, per turn, (end of prompt, end of reply).

    The ids also hold what closes a reply cut at max_tokens; that is history, not a prediction.
    """
    session = engine.create_session(mode="full", budget=budget)
    bounds = []
    for turn in task["turns"]:
        done = await engine.complete(session.id, turn["user"], params)
        bounds.append((done.usage.prompt_tokens, done.usage.prompt_tokens + done.usage.generated_tokens))
    ids = list(session.token_ids)
    await engine.delete_session(session.id)
    return ids, bounds


def follow(engine, mode: str, rocket: RocketKVConfig, ids: list[int], bounds, max_new: int) -> list[torch.Tensor]:
    """Log-probabilities (V,) predicting each reply token of the transcript, turn by turn."""
    cache = engine.new_cache(mode, rocket, f"fidelity-{mode}-{len(ids)}")
    out = []
    try:
        for prompt_end, reply_end in bounds:
            logits = engine.runner.forward(ids[cache.history_len : prompt_end], cache, prefill=True, max_new=max_new)
            out.append(torch.log_softmax(logits, -1))
            for j in range(prompt_end, reply_end - 1):
                out.append(torch.log_softmax(engine.runner.forward([ids[j]], cache, prefill=False), -1))
    finally:
        cache.release()
    return out


def score(reference: list[torch.Tensor], variant: list[torch.Tensor], targets: list[int]) -> tuple[int, float]:
    """(positions where the variant's argmax is the transcript's token, summed KL(full || variant))."""
    agree, kl = 0, 0.0
    for ref, var, target in zip(reference, variant, targets):
        agree += int(var.argmax()) == target
        kl += float((ref.exp() * (ref - var)).sum())
    return agree, kl


async def measure(engines: Engines, tasks: list[dict], variants: dict, budget: int, max_tokens: int,
                  quiet: bool = False) -> dict:
    """{variant name: its agreement and KL against full over every reply position of ``tasks``}.

    A variant is {"mode": cache mode, "rocket": RocketKVConfig fields, "settings": engine settings
    such as reselect or cold_dtype}."""
    with progress(len(tasks) * (2 + len(variants)), "bench fidelity", quiet=quiet, unit="run") as bar:
        return await _measure(engines, tasks, variants, budget, max_tokens, bar)


async def _measure(engines: Engines, tasks: list[dict], variants: dict, budget: int, max_tokens: int, bar) -> dict:
    engine = engines.get({})
    params = SamplingParams(max_tokens=max_tokens)
    transcripts = []
    for t in tasks:
        transcripts.append(await transcript(engine, t, budget, params))
        bar.set_postfix_str("full's transcripts")
        bar.update()
    full = RocketKVConfig(token_budget=budget)
    references = []
    for ids, b in transcripts:
        references.append(follow(engine, "full", full, ids, b, max_tokens))
        bar.set_postfix_str("full's distributions")
        bar.update()
    out = {}
    for name, spec in variants.items():
        mode, overrides = spec["mode"], spec.get("rocket", {})
        engine = engines.get(spec.get("settings", {}))
        rocket = RocketKVConfig(**{"token_budget": budget, "kernel_size": engine.settings.kernel_size, **overrides})
        agree = positions = 0
        kl = 0.0
        for (ids, bounds), ref in zip(transcripts, references):
            targets = [t for p, r in bounds for t in ids[p:r]]
            a, k = score(ref, follow(engine, mode, rocket, ids, bounds, max_tokens), targets)
            agree, kl, positions = agree + a, kl + k, positions + len(targets)
            bar.set_postfix_str(f"{name}: top-1 agreement {agree / max(positions, 1):.1%}")
            bar.update()
        out[name] = {
            "mode": mode, "rocket": overrides, "settings": spec.get("settings", {}), "positions": positions,
            "top1_agreement": round(agree / positions, 4), "mean_kl": round(kl / positions, 5),
        }
    return out


async def run(args) -> dict:
    tasks = load_tasks(args.tasks)[: args.limit or None]
    engines = Engines(quiet=args.quiet)
    result = {"tasks": args.tasks, "budget": args.budget, "conversations": len(tasks)}
    try:
        result["variants"] = await measure(engines, tasks, json.loads(args.variants), args.budget, args.max_tokens,
                                           quiet=args.quiet)
    finally:
        engines.close()
    return result


def main(args) -> int:
    return run_async(run, args)
