"""The four RULER-style task kinds as shared-context conversations: one long context, one question per turn.

Each builder returns ``(context, [(question, answers), ...])``: the context is filled up to a token
target (``count`` measures a piece of text), and every question has its own gold answers, which
occur in the context and in no question. Builders draw only from the ``rng`` they are given, so a
seed fixes the output.

- ``needles``: multi-key needles (RULER's niah_multikey) in Paul Graham essay haystacks, with keys
  that are never asked as distractors;
- ``variables``: variable tracking, chains of ``VAR X = ...`` assignments in repeated noise; a turn
  asks the value its chain's last variable ends up with;
- ``squad`` / ``hotpotqa``: QA over documents, each asked question's gold paragraph(s) among
  distractor paragraphs (first those of the same article or question, then random ones).
"""
from __future__ import annotations

import random
import re
import string
from collections.abc import Callable, Iterator
from itertools import chain
from dataclasses import dataclass

Count = Callable[[str], int]
Question = tuple[str, list[str]]

KEY_ADJECTIVES = ["amber", "brisk", "coastal", "dusky", "eager", "faded", "gilded", "hollow", "ivory", "jagged",
                  "lunar", "mellow", "nimble", "opal", "plain", "quiet", "rustic", "silver", "tidal", "vivid"]
KEY_NOUNS = ["anchor", "badger", "canyon", "dagger", "ember", "falcon", "garnet", "harbor", "island", "juniper",
             "kettle", "lantern", "meadow", "nectar", "orchard", "pebble", "quarry", "ribbon", "saddle", "thistle"]
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
DOC_SEP = "\n\nDocument 10:\n"  # what stands before a document, for its token count
MAX_ANSWER_WORDS = 5  # QA answers a short reply can hold whole


def sentences(text: str) -> list[str]:
    """The essays as sentences, whitespace normalised (the JSON keeps the pages' line breaks)."""
    return re.split(r"(?<=[.!?]) +", " ".join(text.split()))


def take_until(units: Iterator[str], count: Count, room: int, sep: str = " ") -> list[str]:
    """Units from ``units`` while their tokens fit in ``room`` (at least one). Each is counted after
    ``sep``, as it stands in the joined text: a word's tokens differ after a space or a line break."""
    out, used = [], 0
    for unit in units:
        n = count(sep + unit)
        if out and used + n > room:
            break
        out.append(unit)
        used += n
    return out


def insert_at_depths(units: list[str], inserts: list[str], rng: random.Random) -> list[str]:
    """``units`` with each insert at its own random depth, spread over the whole text."""
    n = len(inserts)
    # One depth per n-th of the text, so the asked items are spread from start to end.
    depths = [(i + rng.uniform(0.1, 0.9)) / n for i in range(n)]
    rng.shuffle(depths)
    out = list(units)
    for item, depth in sorted(zip(inserts, depths), key=lambda p: -p[1]):
        out.insert(int(depth * len(units)), item)
    return out


def needles(rng: random.Random, essays: list[str], target: int, count: Count, asked: int,
            distractors: int = 2) -> tuple[str, list[Question]]:
    """Essay sentences from a random one on, with ``asked + distractors`` key-value needles in them."""
    keys = rng.sample([f"{a}-{b}" for a in KEY_ADJECTIVES for b in KEY_NOUNS], asked + distractors)
    values = rng.sample(range(1_000_000, 10_000_000), asked + distractors)
    lines = [f"One of the special magic numbers for {k} is: {v}." for k, v in zip(keys, values)]
    room = target - sum(count(" " + s) for s in lines)
    start = rng.randrange(len(essays))
    haystack = take_until((essays[(start + i) % len(essays)] for i in range(len(essays))), count, room)
    context = " ".join(insert_at_depths(haystack, lines, rng))
    questions = [(f"What is the special magic number for {k}? Answer with the number only.", [str(v)])
                 for k, v in zip(keys[:asked], values[:asked])]
    return context, questions


def variables(rng: random.Random, target: int, count: Count, asked: int, hops: int = 4) -> tuple[str, list[Question]]:
    """Noise lines with ``asked`` chains of ``hops`` assignments each; each chain's last variable is asked."""
    names = rng.sample(sorted({"".join(rng.choices(string.ascii_uppercase, k=5)) for _ in range(4 * asked * (hops + 1))}),
                       asked * (hops + 1))
    values = rng.sample(range(10_000, 100_000), asked)
    chains = []
    for c in range(asked):
        links = names[c * (hops + 1): (c + 1) * (hops + 1)]
        chains.append([f"VAR {links[0]} = {values[c]}."] + [f"VAR {b} = VAR {a}." for a, b in zip(links, links[1:])])
    statements = [s for links in chains for s in links]
    room = target - sum(count("\n" + s) for s in statements)
    noise = take_until(iter(lambda: NOISE, None), count, room, sep="\n")
    # Random slots in the noise (several may share one), each chain's assignments kept in order:
    # a variable is assigned after its source.
    slots = sorted(rng.randrange(len(noise) + 1) for _ in statements)
    order = [c for c, links in enumerate(chains) for _ in links]
    rng.shuffle(order)
    pending = [iter(links) for links in chains]
    placed = iter([next(pending[c]) for c in order])
    out = []
    for i, line in enumerate(noise + [""]):
        out += [next(placed) for _ in range(slots.count(i))] + ([line] if line else [])
    context = "\n".join(out)
    questions = [(f"Follow the chain of assignments: what is the value of VAR {links[-1].split()[1]}? "
                  "Answer with the number only.", [str(values[c])]) for c, links in enumerate(chains)]
    return context, questions


@dataclass(frozen=True)
class QA:
    """One answerable question, its gold documents and the documents that make the best distractors."""

    question: str
    answers: list[str]
    gold: list[str]
    near: list[str]


def squad_pool(articles: list[dict]) -> list[QA]:
    """SQuAD questions with an answer, short answers only; distractors: the same article's paragraphs."""
    pool = []
    for article in articles:
        paragraphs = [p["context"] for p in article["paragraphs"]]
        for p in article["paragraphs"]:
            for qa in p["qas"]:
                answers = list(dict.fromkeys(_span(a["text"]) for a in qa["answers"]))
                if qa.get("is_impossible") or not answers or not _short(answers):
                    continue
                pool.append(QA(qa["question"].strip(), answers, [p["context"]],
                               [d for d in paragraphs if d != p["context"]]))
    return pool


def hotpotqa_pool(rows: list[dict]) -> list[QA]:
    """HotpotQA questions whose answer is a short span of their gold paragraphs (no yes/no questions)."""
    pool = []
    for row in rows:
        docs = {title: f"{title}\n{''.join(text)}" for title, text in row["context"]}
        titles = list(dict.fromkeys(t for t, _ in row["supporting_facts"] if t in docs))
        answer = _span(row["answer"])
        gold = [docs[t] for t in titles]
        if (not gold or answer.lower() in ("yes", "no") or not _short([answer])
                or answer.lower() not in " ".join(gold).lower()):
            continue
        pool.append(QA(row["question"].strip(), [answer], gold, [d for t, d in docs.items() if t not in titles]))
    return pool


def _span(answer: str) -> str:
    """A gold answer as the reply must contain it: a final full stop is the sentence's, not the answer's."""
    return answer.strip().removesuffix(".").strip()


def _short(answers: list[str]) -> bool:
    return all(len(a) >= 2 for a in answers) and min(len(a.split()) for a in answers) <= MAX_ANSWER_WORDS


def pick_questions(rng: random.Random, pool: list[QA], asked: int, used: set[str]) -> list[QA]:
    """``asked`` unused questions with distinct gold documents, none of whose answers occurs in another's question."""
    picked: list[QA] = []
    for i in rng.sample(range(len(pool)), len(pool)):
        qa = pool[i]
        if qa.question in used or any(set(qa.gold) & set(p.gold) for p in picked):
            continue
        questions = [p.question.lower() for p in picked] + [qa.question.lower()]
        answers = [a.lower() for p in picked + [qa] for a in p.answers]
        if any(a in q for a in answers for q in questions):
            continue
        picked.append(qa)
        used.add(qa.question)
        if len(picked) == asked:
            return picked
    raise ValueError(f"not enough questions left for {asked} more")


def documents(rng: random.Random, picked: list[QA], every_doc: list[str], target: int, count: Count) -> str:
    """The gold documents, then the nearest distractors, then random ones, up to ``target``; shuffled."""
    gold = list(dict.fromkeys(d for qa in picked for d in qa.gold))
    near = [d for d in dict.fromkeys(d for qa in picked for d in qa.near) if d not in gold]
    rng.shuffle(near)
    others = (every_doc[i] for i in rng.sample(range(len(every_doc)), len(every_doc)))
    fresh = _unseen(chain(near, others), set(gold))
    room = target - sum(count(DOC_SEP + d) for d in gold)
    docs = gold + take_until(fresh, count, room, sep=DOC_SEP)
    rng.shuffle(docs)
    return "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(docs))


def _unseen(docs: Iterator[str], seen: set[str]) -> Iterator[str]:
    """Each document of ``docs`` once, none of those in ``seen``."""
    for d in docs:
        if d not in seen:
            seen.add(d)
            yield d


def over_documents(rng: random.Random, pool: list[QA], every_doc: list[str], target: int, count: Count, asked: int,
       used: set[str]) -> tuple[str, list[Question]]:
    """``asked`` questions of ``pool`` not in ``used``, over their gold documents among distractors."""
    picked = pick_questions(rng, pool, asked, used)
    questions = [(f"Question: {p.question} Answer with a short phrase from the documents only.", p.answers)
                 for p in picked]
    context = documents(rng, picked, every_doc, target, count)
    return context, questions
