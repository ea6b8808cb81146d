"""Whether a reply of ``bench soak`` that differs from the reference run's is a tie that float noise flips,
or a sign of wrong KV: the soak's own transcript fed through a fresh cache of the same mode and settings,
teacher-forced (as ``bench.fidelity`` reads one), scoring each token the soak chose against the
reference's top logit.

The server's batched steps sum in an order that depends on the rows beside a session's (oneDNN's GEMM
blocks by the number of rows), so two runs of one conversation can part at a near tie, where the top two
logits are within float noise; a cache served from the wrong KV instead puts the soak's tokens far below
the top. ``MARGIN`` is that line, in logits.
"""
from __future__ import annotations

from dataclasses import dataclass

MARGIN = 0.05


@dataclass
class Transcript:
    """A session as its server holds it: token ids, and each turn's (end of prompt, end of reply)."""

    ids: list[int]
    turns: list[tuple[int, int]]


def transcript_of(token_ids: list[int], turn_stats: list[dict]) -> Transcript | None:
    """From a session's export (``token_ids``) and detail (``turn_stats``: prompt and generated tokens);
    None where they do not fit together."""
    turns = [(t["prompt_tokens"], t["prompt_tokens"] + t["generated_tokens"]) for t in turn_stats]
    if any(b > len(token_ids) or a > b for a, b in turns):
        return None
    return Transcript(list(token_ids), turns)


def gaps(engine, mode: str, transcript: Transcript, upto: int, max_new: int) -> list[float]:
    """For each reply token of turns 0..``upto``: the reference's top logit less the logit of the token the
    transcript holds (0 where it is the top). Fed as the engine feeds a turn: the prompt in one prefill
    (``max_new`` for its budget split), the reply one token at a time, the turn's end."""
    _, rocket = engine.session_config(mode)
    cache = engine.new_cache(mode, rocket, "soak-forced")
    ids, out = transcript.ids, []
    try:
        for prompt_end, reply_end in transcript.turns[: upto + 1]:
            logits = engine.runner.forward(ids[cache.history_len : prompt_end], cache, prefill=True, max_new=max_new)
            for j in range(prompt_end, reply_end):
                out.append(float(logits.max() - logits[ids[j]]))
                if j + 1 < reply_end:
                    logits = engine.runner.forward([ids[j]], cache, prefill=False)
            cache.end_turn()
    finally:
        cache.release()
    return out
