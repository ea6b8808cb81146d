"""What a served turn samples with where its request leaves a value out.

Each value, in order: the server's setting (``RKV_DEFAULT_TEMPERATURE``, ...), the served model's own
generation config (the values its authors publish with it; all of them or none, as vLLM applies
them), else the chat defaults. ``SamplingParams()`` itself stays greedy: the evals and benchmarks that
call the engine directly pass their own values.

The chat defaults were chosen on ``bench chat`` (docs/benchmarks.md, "chat"): with both bundled models
they recalled as many facts as llama.cpp's server's defaults (temperature 0.8, top-k 40, top-p 0.95,
min-p 0.05) or more, and looped in fewer replies; a mild repetition penalty is what ends the loops.
"""
from __future__ import annotations

from typing import Any

from app.engine.sampling import SHAPING, SamplingParams

CHAT_DEFAULTS: dict[str, float | int] = {"temperature": 0.7, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.05}


def model_generation(config: Any) -> dict[str, float | int]:
    """The sampling values a model's ``GenerationConfig`` sets (only those its file sets: a GGUF, which
    carries none, gives {}). A config that says ``do_sample: false`` asks for greedy decoding."""
    if config is None:
        return {}
    given = config.to_diff_dict()
    values = {k: v for k, v in given.items() if k in SHAPING and v is not None}
    if given.get("do_sample") is False:
        values["temperature"] = 0.0
    return values


def served_defaults(settings: Any, model_values: dict[str, float | int]) -> dict[str, float | int]:
    """The shaping values a turn gets for what it does not send, checked as a request's would be."""
    base = dict(model_values) if model_values else dict(CHAT_DEFAULTS)
    for name in SHAPING:
        value = getattr(settings, f"default_{name}", None)
        if value is not None:
            base[name] = value
    return SamplingParams.parse(**base).shaping()
