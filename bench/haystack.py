"""Synthetic long-context text: filler with facts hidden at chosen depths (deterministic)."""
from __future__ import annotations

import random

_SENTENCES = [
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
    "The river runs past the old mill.",
    "A light wind moves across the hills.",
    "The market opens early on weekdays.",
    "Clouds gather slowly over the valley.",
    "The road bends north after the bridge.",
]


def filler_text(n_words: int, seed: int = 0) -> str:
    """About ``n_words`` words of calm, fact-free filler."""
    rng = random.Random(seed)
    out, words = [], 0
    while words < n_words:
        s = rng.choice(_SENTENCES)
        out.append(s)
        words += len(s.split())
    return " ".join(out)


def hide(facts: list[str], n_words: int, depths: list[float], seed: int = 0) -> str:
    """Filler of ~n_words with each fact inserted at its relative depth (0 = start, 1 = end)."""
    sentences = filler_text(n_words, seed).split(". ")
    for fact, depth in sorted(zip(facts, depths), key=lambda fd: -fd[1]):
        at = int(round(depth * len(sentences)))
        sentences.insert(at, fact.rstrip("."))
    return ". ".join(sentences)
