"""Shared helpers for the benchmarks: engine loading, prompts of an exact size, JSON output."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.haystack import filler_text
from bench.provenance import stamp

# What a benchmark's turns send to a server: plain greedy decoding, whatever the server's chat defaults
# (the engine's ``SamplingParams()``; tests/bench/test_greedy_requests.py keeps the two equal).
GREEDY: dict[str, float | int] = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                                  "repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}


# Bench mode names beyond the cache modes: a cache mode plus engine settings.
VARIANTS: dict[str, tuple[str, dict]] = {
    "tiered-exhaustive": ("tiered", {"reselect": "exhaustive"}),
    "tiered-digest": ("tiered", {"reselect": "digest"}),
    # pages of similar keys ranked by their bounds alone (the default), whatever RKV_SKETCH_BITS says
    "tiered-bounds": ("tiered", {"reselect": "digest", "sketch_bits": 0, "page_grouping": "keys"}),
    # a 4-bit key sketch of every cold token, pages by position (``RKV_SKETCH_BITS=4 RKV_PAGE_GROUPING=position``)
    "tiered-sketch": ("tiered", {"reselect": "digest", "sketch_bits": 4, "page_grouping": "position"}),
    "tiered-int8": ("tiered", {"reselect": "digest", "cold_dtype": "int8"}),
}
TRAFFIC_FIELDS = ("cold_bytes_read", "redis_bytes_read", "digest_bytes_read", "bytes_demoted", "redis_bytes_written")


def variant(name: str) -> tuple[str, dict]:
    """(cache mode, engine settings) of a bench mode name: a cache mode, or one of ``VARIANTS``."""
    return VARIANTS.get(name, (name, {}))


class Engines:
    """One engine per distinct settings, all sharing one loaded model (``quiet``: no bar, should the model
    be converted first)."""

    def __init__(self, quiet: bool = False, **base):
        self.base = base
        self.quiet = quiet
        self._engines: dict[tuple, object] = {}
        self._borrowed: set[tuple] = set()
        self._loaded = None

    @classmethod
    def around(cls, engine) -> "Engines":
        """Engines whose plain member is ``engine`` (closed by its owner, not here)."""
        engines = cls(**engine.settings.model_dump())
        engines._engines[()] = engine
        engines._borrowed.add(())
        engines._loaded = engine.loaded
        return engines

    def get(self, overrides: dict):
        from app.engine.engine import Engine
        from app.model_loader import load_model
        from app.settings import Settings

        key = tuple(sorted(overrides.items()))
        if key not in self._engines:
            settings = Settings(**{**self.base, **overrides})
            loaded = self._loaded or load_model(settings, quiet=self.quiet)
            self._engines[key] = engine = Engine(settings, loaded=loaded)
            self._loaded = engine.loaded
        return self._engines[key]

    def alone(self, overrides: dict):
        """The engine of these settings, every other one (not borrowed) closed first. Its model thread
        is then the only one working in the process, as in a replica: two model threads, each with its
        own OpenMP team, slow each other down on a few cores even when one of them is idle."""
        key = tuple(sorted(overrides.items()))
        for other in [k for k in self._engines if k != key and k not in self._borrowed]:
            self._engines.pop(other).close()
        return self.get(overrides)

    def close(self) -> None:
        for key, engine in self._engines.items():
            if key not in self._borrowed:
                engine.close()


def load_engine(quiet: bool = False, **overrides):
    from app.engine.engine import Engine
    from app.model_loader import load_model
    from app.settings import Settings

    settings = Settings(**overrides)
    return Engine(settings, loaded=load_model(settings, quiet=quiet))


def fit_words(tokenizer, text: str, n_tokens: int) -> str:
    """The longest prefix of ``text`` (cut at a sentence end) that encodes to at most n_tokens."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:n_tokens]
    cut = tokenizer.decode(ids)
    end = cut.rfind(". ")
    return cut[: end + 1] if end > 0 else cut


def chat_prompt_ids(tokenizer, content: str) -> list[int]:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]


def context_ids(tokenizer, n_tokens: int, question: str, seed: int = 0) -> list[int]:
    """A chat prompt of about n_tokens: filler followed by ``question``."""
    overhead = len(chat_prompt_ids(tokenizer, question)) + 2
    filler = fit_words(tokenizer, filler_text(n_tokens, seed), n_tokens - overhead)
    return chat_prompt_ids(tokenizer, filler + "\n\n" + question)


def write_json(result: dict, path: str | None, quiet: bool = False) -> None:
    """Write the result, stamped with its command, machine and commit, to ``path`` (and stdout unless
    ``quiet``: partial results only go to the file)."""
    text = json.dumps(stamp(result), indent=2)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text + "\n")
    if not quiet:
        sys.stdout.write(text + "\n")


def run_async(run, args) -> int:
    """Entry point of an async benchmark: ``await run(args)``, then write its result."""
    import asyncio

    write_json(asyncio.run(run(args)), args.json_out)
    return 0
