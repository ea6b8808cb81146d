"""Writes the multi-turn recall task files: long filler with 4 facts, then one question per turn.

``python -m bench.make_tasks`` regenerates ``bench/tasks/*.jsonl`` (deterministic). Every turn asks
about a different fact, so a later turn needs tokens that an earlier turn's window ignored.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from bench.haystack import hide

KINDS = ["red", "blue", "green", "yellow", "white", "black", "orange", "purple"]
DEPTHS = [0.12, 0.37, 0.62, 0.87]
WORDS_PER_TOKEN = 0.78  # the filler's words per SmolLM2 token, measured on this generator


def conversation(idx: int, n_tokens: int, rng: random.Random) -> dict:
    kinds = rng.sample(KINDS, 4)
    keys = [str(rng.randint(10000, 99999)) for _ in kinds]
    facts = [f"The pass key for the {k} door is {v}." for k, v in zip(kinds, keys)]
    depths = rng.sample(DEPTHS, 4)
    doc = hide(facts, int(n_tokens * WORDS_PER_TOKEN), depths, seed=idx * 7 + n_tokens)
    order = rng.sample(range(4), 4)
    turns = []
    for t, i in enumerate(order):
        question = f"What is the pass key for the {kinds[i]} door? Answer with the number only."
        user = (
            "Read the text below; it hides pass keys for several doors.\n\n" + doc + "\n\n" + question
            if t == 0
            else question
        )
        turns.append({"user": user, "answer": keys[i]})
    return {"id": f"mt{n_tokens // 1000}k-{idx:02d}", "turns": turns}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(Path(__file__).parent / "tasks"))
    parser.add_argument("--conversations", type=int, default=8)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, n_tokens in (("mt_2k.jsonl", 2000), ("mt_5k.jsonl", 5700)):
        rng = random.Random(n_tokens)
        rows = [conversation(i, n_tokens, rng) for i in range(args.conversations)]
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
