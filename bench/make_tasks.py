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

# (fact template, question, answers): each conversation draws 4 distinct kinds of fact.
FACTS = [
    ("The pass key is {n}.", "What is the pass key? Answer with the number only.", "number"),
    ("The meeting is in room {n}.", "In which room is the meeting? Answer with the room number only.", "number"),
    ("{name}'s favourite colour is {colour}.", "What is {name}'s favourite colour?", "colour"),
    ("The capital of {land} is {city}.", "What is the capital of {land}?", "city"),
    ("{name2} keeps a pet {animal}.", "What kind of pet does {name2} keep?", "animal"),
    ("The secret ingredient of the soup is {food}.", "What is the secret ingredient of the soup?", "food"),
]
NAMES = ["Mary", "Omar", "Lena", "Ravi", "Sofia", "Tomas", "Aiko", "Bruno"]
COLOURS = ["purple", "orange", "turquoise", "crimson", "silver", "amber"]
LANDS = ["Veltria", "Norvania", "Quellis", "Darmonia", "Estrelia", "Kovania"]
CITIES = ["Orlin", "Pasko", "Merivale", "Tarsus", "Vindel", "Halvik"]
ANIMALS = ["parrot", "tortoise", "hedgehog", "ferret", "goldfish", "rabbit"]
FOODS = ["saffron", "ginger", "fennel", "nutmeg", "basil", "cardamom"]
DEPTHS = [0.12, 0.37, 0.62, 0.87]
WORDS_PER_TOKEN = 0.78  # the filler's words per SmolLM2 token, measured on this generator


def fill(rng: random.Random, template: str, question: str, kind: str) -> tuple[str, str, str]:
    values = {
        "n": str(rng.randint(10000, 99999)) if "pass key" in template else str(rng.randint(100, 999)),
        "name": rng.choice(NAMES[:4]),
        "name2": rng.choice(NAMES[4:]),
        "colour": rng.choice(COLOURS),
        "land": rng.choice(LANDS),
        "city": rng.choice(CITIES),
        "animal": rng.choice(ANIMALS),
        "food": rng.choice(FOODS),
    }
    answer = values["n"] if kind == "number" else values[kind]
    return template.format(**values), question.format(**values), answer


def conversation(idx: int, n_tokens: int, rng: random.Random) -> dict:
    picked = [fill(rng, *f) for f in rng.sample(FACTS, 4)]
    facts = [fact for fact, _, _ in picked]
    doc = hide(facts, int(n_tokens * WORDS_PER_TOKEN), rng.sample(DEPTHS, 4), seed=idx * 7 + n_tokens)
    turns = []
    for t, i in enumerate(rng.sample(range(4), 4)):
        _, question, answer = picked[i]
        user = "Read the text below.\n\n" + doc + "\n\n" + question if t == 0 else question
        turns.append({"user": user, "answer": answer})
    return {"id": f"mt{n_tokens // 1000}k-{idx:02d}", "turns": turns}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(Path(__file__).parent / "tasks"))
    parser.add_argument("--conversations", type=int, default=16, help="conversations of the 2k and 5k files")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # The 8k file is for the larger evaluation model (budget 256 keeps under a fifth of its history);
    # 8 conversations of it take about as long as 16 of the others.
    for name, n_tokens, count in (("mt_2k.jsonl", 2000, args.conversations), ("mt_5k.jsonl", 5700, args.conversations),
                                  ("mt_8k.jsonl", 8000, max(1, args.conversations // 2))):
        rng = random.Random(n_tokens)
        rows = [conversation(i, n_tokens, rng) for i in range(count)]
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
