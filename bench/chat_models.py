"""``rocketkv-mt bench chat``: how well a model chats, with the sampling a served turn gets.

A short chat set of our own (``CONVERSATIONS``): the first message gives a name and two facts, then five
turns ask for them (one fact, the other, both) and give one small instruction. Per model: recalls
correct (the reply holds the fact), instructions followed, replies that loop (a 4-word phrase three
times, or a reply cut at ``max_tokens`` that repeats itself), and decode tokens per second on this
machine. Every model runs the same conversations with the same seeds, one model at a time, the
session's cache ``full`` (the model is compared here, not the cache).
"""
from __future__ import annotations

import asyncio
import re
import time
from collections import Counter
from dataclasses import dataclass

from app.engine.sampling import SamplingParams


@dataclass(frozen=True)
class Ask:
    text: str
    expect: tuple[str, ...] = ()  # recall: every one of these in the reply (case-insensitive)
    follows: str | None = None  # instruction: a regular expression the whole reply must match


CONVERSATIONS: tuple[tuple[str, tuple[Ask, ...]], ...] = (
    ("Hi! My name is Ada and I keep bees in Lisbon.", (
        Ask("Where do I keep my bees?", ("lisbon",)),
        Ask("What is my name?", ("ada",)),
        Ask("Reply with just the word yes.", follows=r"\W*yes\W*"),
        Ask("What animals do I keep?", ("bee",)),
        Ask("Tell me my name and my city.", ("ada", "lisbon")),
    )),
    ("Hello, I'm Tomas. I play the cello and my dog is called Pepper.", (
        Ask("What instrument do I play?", ("cello",)),
        Ask("What is my dog's name?", ("pepper",)),
        Ask("Count from one to five, digits only.", follows=r"\D*1\D+2\D+3\D+4\D+5\D*"),
        Ask("What is my name?", ("tomas",)),
        Ask("Remind me: what is my dog called and what do I play?", ("pepper", "cello")),
    )),
    ("I'm Mei. I work as a nurse and I live in Osaka.", (
        Ask("What is my job?", ("nurse",)),
        Ask("Which city do I live in?", ("osaka",)),
        Ask("Say hello in French, one word only.", follows=r"\W*(bonjour|salut)\W*"),
        Ask("What is my name?", ("mei",)),
        Ask("Sum up my name and my job in one sentence.", ("mei", "nurse")),
    )),
    ("My name is Lars. I grow tomatoes and I drive a red van.", (
        Ask("What do I grow?", ("tomato",)),
        Ask("What colour is my van?", ("red",)),
        Ask("Answer with one number: what is 3 + 4?", follows=r"\D*7\D*"),
        Ask("What is my name?", ("lars",)),
        Ask("What do I grow and what do I drive?", ("tomato", "van")),
    )),
)


def loops(text: str, finish: str, n: int = 4) -> bool:
    """A reply that repeats a phrase of ``n`` words three times, or that ran to its cap repeating one
    twice (what a loop looks like when it is cut)."""
    words = re.findall(r"\w+|[^\w\s]", text.lower())
    grams = Counter(tuple(words[i:i + n]) for i in range(len(words) - n + 1))
    top = max(grams.values(), default=0)
    return top >= 3 or (finish == "length" and top >= 2)


async def run_model(engine, sampling: dict, seeds: list[int], max_tokens: int,
                    conversations=CONVERSATIONS) -> dict:
    from app.session_restore import checked_sampling

    recalls = recall_total = follows = follow_total = looped = replies = 0
    generated = decode_s = 0.0
    examples: list[dict] = []
    for seed in seeds:
        for first, asks in conversations:
            session = engine.create_session(mode="full")
            turns = [Ask(first)] + list(asks)
            for ask in turns:
                params = checked_sampling({**sampling, "seed": seed, "max_tokens": max_tokens}, engine.sampling_defaults)
                t0 = time.perf_counter()
                done = await engine.complete(session.id, ask.text, params)
                wall = time.perf_counter() - t0
                text, replies = done.text, replies + 1
                if done.usage.generated_tokens > 1:
                    generated += done.usage.generated_tokens - 1
                    decode_s += max(wall - done.ttft_ms / 1000, 1e-9)
                bad_loop = loops(text, done.finish_reason)
                looped += bad_loop
                ok = None
                if ask.expect:
                    recall_total += 1
                    ok = all(e in text.lower() for e in ask.expect)
                    recalls += ok
                elif ask.follows:
                    follow_total += 1
                    ok = re.fullmatch(ask.follows, text.strip().lower(), re.S) is not None
                    follows += ok
                if seed == seeds[0] and first == conversations[0][0]:
                    examples.append({"user": ask.text, "reply": text[:300], "correct": ok, "loop": bad_loop})
            await engine.delete_session(session.id)
    return {
        "recalls": recalls, "recall_questions": recall_total,
        "instructions": follows, "instruction_questions": follow_total,
        "loops": looped, "replies": replies,
        "decode_tokens_per_s": round(generated / decode_s, 2) if decode_s else None,
        "example": examples,
    }


def run(args) -> dict:
    from app.engine.engine import Engine
    from app.model_registry import display_name
    from app.settings import Settings

    import json

    sampling = json.loads(args.sampling) if args.sampling else {}
    seeds = list(range(args.seeds))
    models = {}
    for model in args.models.split(","):
        engine = Engine(Settings(model=model, mode="full"))
        try:
            result = asyncio.run(run_model(engine, sampling, seeds, args.max_tokens))
            result["sampling"] = SamplingParams.parse(**{**engine.sampling_defaults, **sampling}).shaping()
            result["title"] = display_name(model)
            models[model] = result
        finally:
            engine.close()
        print(f"{model}: {result['recalls']}/{result['recall_questions']} recalls, "
              f"{result['instructions']}/{result['instruction_questions']} instructions, {result['loops']} loops, "
              f"{result['decode_tokens_per_s']} tokens/s", flush=True)
    return {"chat_models": models, "command_sampling": sampling, "seeds": seeds, "max_tokens": args.max_tokens,
            "conversations": len(CONVERSATIONS), "turns": 1 + len(CONVERSATIONS[0][1])}


def main(args) -> int:
    from bench.common import write_json

    write_json(run(args), args.json_out)
    return 0
