"""A synthetic chat trace for ``bench placement``: conversations arriving, their turns and the idle gaps
between them, sized from public chat-trace statistics.

- Turns per conversation: mean 2.0 in LMSYS-Chat-1M and 3.5 in ShareGPT (Zheng et al. 2023,
  "LMSYS-Chat-1M", arXiv 2309.11998, Table 1), with a long tail of long chats. Here: 1 + a geometric
  count, from a mix of short chats (85%, mean 2 turns) and long ones (15%, mean 8): mean 2.9.
- Tokens per user message: mean 69.5 (LMSYS-Chat-1M) and 94.9 (ShareGPT), same source. Here: log-normal,
  median 40, sigma 1.1 (mean ~73).
- Tokens per reply: mean 214.5 (LMSYS-Chat-1M) and 348.5 (ShareGPT). Here: log-normal, median 180,
  sigma 0.8 (mean ~250), cut at the turn's ``max_new``.
- Pasted documents: chats that open with a long context make the load skewed in bytes, the case that
  placement by memory is for. Here ``doc_share`` of conversations (default 10%) open with a log-normal
  document of median ``doc_median`` tokens (default 4,000), sigma 0.8, at most 32k.
- Idle gaps between turns (a person reading and typing): tens of seconds, with a tail of minutes; in a
  production to-C trace 80% of KV reuses came within 10 minutes (Wang et al. 2025, "KVCache Cache in
  the Wild", arXiv 2506.02634). Here: log-normal, median 30 s, sigma 1.0 (mean ~50 s), at most 15 min.
- Arrivals: Poisson, ``rate`` conversations a second, ``burst_factor`` times that for ``burst_s`` from
  ``burst_at`` (default: 4x for two minutes, a third of the way in: a class or a launch arriving at once).
- Cache modes: ``full_share`` of sessions (default 20%) in ``full`` (grows with the history), the rest
  ``tiered`` (the server's default: a budget-sized set on the device).

These are this project's choices fitted to the published means, not a replay of either dataset.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Turn:
    think_s: float  # idle time before this turn (0 for the first)
    prompt: int  # tokens of the user's message (a pasted document included)
    reply: int  # tokens the reply generates


@dataclass(frozen=True)
class Conversation:
    id: str
    arrival: float  # seconds from the trace's start
    mode: str
    turns: list[Turn] = field(default_factory=list)


@dataclass(frozen=True)
class TraceShape:
    rate: float = 1.0  # conversations a second
    duration_s: float = 1800.0  # arrivals stop after this
    long_share: float = 0.15  # conversations drawn from the long-chat part of the turn count
    short_turns: float = 2.0
    long_turns: float = 8.0
    prompt_median: float = 40.0
    prompt_sigma: float = 1.1
    reply_median: float = 180.0
    reply_sigma: float = 0.8
    max_new: int = 512
    doc_share: float = 0.10
    doc_median: float = 4000.0
    doc_sigma: float = 0.8
    doc_max: int = 32_768
    think_median_s: float = 30.0
    think_sigma: float = 1.0
    think_max_s: float = 900.0
    full_share: float = 0.20
    burst_at: float = 600.0
    burst_s: float = 120.0
    burst_factor: float = 4.0

    def rate_at(self, t: float) -> float:
        return self.rate * (self.burst_factor if self.burst_at <= t < self.burst_at + self.burst_s else 1.0)


def _lognormal(rng: random.Random, median: float, sigma: float, high: float) -> float:
    return min(high, rng.lognormvariate(math.log(median), sigma))


def _turn_count(rng: random.Random, mean: float) -> int:
    """1 + a geometric count of further turns, ``mean`` turns on average."""
    p = 1.0 / mean
    n = 1
    while rng.random() > p:
        n += 1
    return n


def synthetic_trace(shape: TraceShape, seed: int = 0) -> list[Conversation]:
    rng = random.Random(seed)
    conversations, t, i = [], 0.0, 0
    peak = shape.rate * max(1.0, shape.burst_factor)
    while True:
        t += rng.expovariate(peak)
        if t >= shape.duration_s:
            return conversations
        if rng.random() * peak > shape.rate_at(t):  # thinning: Poisson at the rate of the moment
            continue
        mean = shape.long_turns if rng.random() < shape.long_share else shape.short_turns
        doc = int(_lognormal(rng, shape.doc_median, shape.doc_sigma, shape.doc_max)) if rng.random() < shape.doc_share else 0
        turns = []
        for k in range(_turn_count(rng, mean)):
            think = 0.0 if k == 0 else _lognormal(rng, shape.think_median_s, shape.think_sigma, shape.think_max_s)
            prompt = max(1, int(_lognormal(rng, shape.prompt_median, shape.prompt_sigma, 8192))) + (doc if k == 0 else 0)
            reply = max(1, min(shape.max_new, int(_lognormal(rng, shape.reply_median, shape.reply_sigma, 1e9))))
            turns.append(Turn(think, prompt, reply))
        mode = "full" if rng.random() < shape.full_share else "tiered"
        conversations.append(Conversation(f"s_{i:07d}", t, mode, turns))
        i += 1


def trace_figures(trace: list[Conversation]) -> dict[str, float]:
    """What the drawn trace holds, to set beside the published means."""
    turns = [t for c in trace for t in c.turns]
    gaps = [t.think_s for t in turns if t.think_s > 0]
    return {
        "conversations": len(trace),
        "turns": len(turns),
        "mean_turns": round(len(turns) / max(1, len(trace)), 2),
        "mean_prompt_tokens": round(sum(t.prompt for t in turns) / max(1, len(turns)), 1),
        "mean_reply_tokens": round(sum(t.reply for t in turns) / max(1, len(turns)), 1),
        "mean_gap_s": round(sum(gaps) / max(1, len(gaps)), 1),
        "full_share": round(sum(c.mode == "full" for c in trace) / max(1, len(trace)), 3),
    }
