"""``rocketkv-mt eval``: multi-turn recall per cache mode, greedy, all modes in one run.

Task file: one conversation per line, ``{"id": ..., "turns": [{"user": ..., "answer": ...}, ...]}``;
a turn is correct when ``answer`` occurs, case-insensitively, in the reply. A turn with several gold
answers (a QA set's annotators) lists them all under ``answers``: any one of them counts. A
conversation with a ``kind`` (the RULER-based files) is also counted under it, in ``per_kind``. On a
terminal a bar counts the turns of all modes, with the mode under way and its running accuracy
(``--quiet``: none).
"""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from app.engine.sampling import SamplingParams
from app.progress import progress as progress_bar
from app.settings import Settings
from bench.common import TRAFFIC_FIELDS, Engines, variant, write_json


def load_tasks(path: str) -> list[dict]:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    for row in rows:
        if not row.get("turns") or not all("user" in t and "answer" in t for t in row["turns"]):
            raise ValueError(f"task {row.get('id')!r}: every turn needs 'user' and 'answer'")
        for turn in row["turns"]:
            golds = turn.get("answers", [turn["answer"]])
            if not golds or not all(isinstance(g, str) and g.strip() for g in golds):
                raise ValueError(f"task {row.get('id')!r}: 'answers' must be a list of non-empty strings")
    return rows


def pick(tasks: list[dict], ids: str = "", limit: int = 0) -> list[dict]:
    """The conversations to run: those named in ``ids`` (comma-separated, in the file's order; every
    name must be there), else all; then the first ``limit`` of them (0: no limit)."""
    wanted = [i for i in ids.split(",") if i]
    if wanted:
        missing = sorted(set(wanted) - {t["id"] for t in tasks})
        if missing:
            raise ValueError(f"no conversation with id {', '.join(map(repr, missing))} in the task file")
        tasks = [t for t in tasks if t["id"] in wanted]
    return tasks[:limit] if limit else tasks


def answered(turn: dict, reply: str) -> bool:
    """Whether one of the turn's gold answers occurs in the reply, case-insensitively."""
    text = reply.lower()
    return any(gold.lower() in text for gold in turn.get("answers", [turn["answer"]]))


async def run_mode(engine, mode: str, tasks: list[dict], budget: int, max_tokens: int, progress=None, bar=None) -> dict:
    """One mode over every task; ``progress(partial summary)`` after each conversation, and ``bar`` (a
    ``tqdm``) advanced by each turn with the running accuracy."""
    n_turns = max(len(t["turns"]) for t in tasks)
    per_turn = [[0, 0] for _ in range(n_turns)]
    peak, latencies, replies = 0, [], []
    traffic = dict.fromkeys(TRAFFIC_FIELDS, 0)
    per_kind: dict[str, list[int]] = {}
    params = SamplingParams(max_tokens=max_tokens)
    for task in tasks:
        session = engine.create_session(mode=mode, budget=budget)
        convo = []
        for i, turn in enumerate(task["turns"]):
            t0 = time.perf_counter()
            done = await engine.complete(session.id, turn["user"], params)
            latencies.append((time.perf_counter() - t0) * 1000)
            ok = answered(turn, done.text)
            per_turn[i][0] += ok
            per_turn[i][1] += 1
            if "kind" in task:
                counts = per_kind.setdefault(task["kind"], [0, 0])
                counts[0] += ok
                counts[1] += 1
            if bar is not None:
                right, total = sum(c for c, _ in per_turn), sum(n for _, n in per_turn)
                bar.set_postfix_str(f"{mode}: accuracy {right / total:.0%} ({right}/{total})")
                bar.update()
            peak = max(peak, done.memory.device_bytes)
            for k in traffic:
                traffic[k] += getattr(done.memory, k)
            convo.append({"reply": done.text, "correct": ok, "readmitted": done.memory.readmitted_tokens})
        replies.append({"id": task["id"], "turns": convo})
        await engine.delete_session(session.id)
        if progress is not None:
            progress(summary(per_turn, peak, latencies, replies, traffic, per_kind))
    return summary(per_turn, peak, latencies, replies, traffic, per_kind)


def summary(per_turn, peak, latencies, replies, traffic=None, per_kind=None) -> dict:
    right = sum(c for c, _ in per_turn)
    total = sum(n for _, n in per_turn)
    kinds = {"per_kind": {k: {"correct": c, "total": n} for k, (c, n) in per_kind.items()}} if per_kind else {}
    return {
        "accuracy": round(right / max(total, 1), 4),
        "correct": right,
        "total": total,
        "per_turn_accuracy": [round(c / max(n, 1), 4) for c, n in per_turn],
        "peak_device_kv_bytes": peak,
        "mean_turn_latency_ms": round(sum(latencies) / max(len(latencies), 1), 1),
        "mean_bytes_per_turn": {k: round(v / max(len(latencies), 1)) for k, v in (traffic or {}).items()},
        **kinds,
        "replies": replies,
    }


def main(args) -> int:
    tasks = pick(load_tasks(args.tasks), args.ids, args.limit)
    engines = Engines(quiet=args.quiet,
                      **({"prefill_attention": args.prefill_attention} if args.prefill_attention else {}))
    modes = [m for m in args.modes.split(",") if m]
    result = {"model": Settings(**engines.base).model, "budget": args.budget, "tasks": args.tasks,
              "conversations": len(tasks), "modes": {}}
    turns = sum(len(t["turns"]) for t in tasks) * len(modes)
    with progress_bar(turns, "eval", quiet=args.quiet, unit="turn") as bar:
        for mode in modes:

            def progress(partial: dict, mode=mode) -> None:
                result["modes"][mode] = partial
                write_json({**result, "partial": True}, args.json_out, quiet=True)

            cache_mode, overrides = variant(mode)
            engine = engines.get(overrides)
            result["modes"][mode] = asyncio.run(
                run_mode(engine, cache_mode, tasks, args.budget, args.max_tokens, progress, bar))
    engines.close()
    summary = {m: {k: v for k, v in r.items() if k != "replies"} for m, r in result["modes"].items()}
    if not args.details:
        result["modes"] = summary
    write_json(result, args.json_out)
    return 0
