"""Per-request sampling settings and the token sampler (a whole batched step's rows at once, on the model thread).

The logits of a step's rows pass, as tensors over the whole batch, through the same stages as in
transformers' ``generate`` (and vLLM): repetition penalty, frequency and presence penalties,
temperature, top-k, top-p, min-p; then greedy rows take the argmax and sampled rows draw. No stage
loops over the vocabulary in Python; a seeded row draws from its own generator, so its tokens do not
depend on who shares its steps.
"""
from __future__ import annotations

from typing import Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from app.engine.errors import InvalidSamplingParams

# The knobs that shape the distribution (all but max_tokens, stop and seed): what a server's defaults set.
SHAPING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")


class SamplingParams(BaseModel):
    """How one turn's reply is generated. The defaults are plain greedy decoding (what the engine's own
    callers, the evals and the benchmarks use); a server fills in its chat defaults before a turn."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    max_tokens: int | None = Field(None, ge=1, description="Cap on generated tokens (default: the server's).")
    temperature: float = Field(0.0, ge=0.0, le=5.0, description="Softmax temperature; 0 picks the argmax.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling: smallest set with this much mass.")
    top_k: int = Field(0, ge=-1, le=100_000, description="Keep the k most likely tokens; 0 or -1: all.")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="Drop tokens under this fraction of the top token's probability.")
    repetition_penalty: float = Field(
        1.0, ge=0.01, le=10.0, description="Divide (multiply, when negative) the logits of tokens already in the "
        "conversation or the reply by this; 1: off.")
    frequency_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, description="Subtract this times a token's count in the reply so far from its logit.")
    presence_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, description="Subtract this from the logit of every token the reply has used.")
    stop: tuple[str, ...] = Field((), max_length=8, description="Strings that end the reply (not included).")
    seed: int | None = Field(None, ge=0, description="Seed for reproducible sampling.")

    @classmethod
    def parse(cls, **values) -> "SamplingParams":
        """Validate, raising the engine's ``InvalidSamplingParams`` with the offending fields."""
        try:
            return cls(**{k: v for k, v in values.items() if v is not None})
        except ValidationError as exc:
            fields = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise InvalidSamplingParams(f"invalid sampling parameters: {fields}") from None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def plain(self) -> bool:
        """The argmax of the raw logits: nothing to compute but that."""
        return self.greedy and not self.penalized

    def shaping(self) -> dict[str, float | int]:
        """The values that shape the distribution."""
        return {name: getattr(self, name) for name in SHAPING}

    def reported(self) -> dict[str, float | int | None]:
        """What a turn's ``done`` says it was drawn with (greedy: temperature 0, the rest moot but shown)."""
        return {**self.shaping(), "seed": self.seed}


class TokenSampler:
    """How one request's tokens are drawn, and what its penalties need to know: the ids of the
    conversation before the reply and the reply's tokens so far. Its tensors live on the model
    thread's device and are made there, at the first draw; ``context`` is copied at construction,
    as the caller's list goes on growing."""

    def __init__(self, params: SamplingParams, device: torch.device, context: Sequence[int] = ()):
        self.params = params
        self.device = torch.device(device)
        self.generator = _make_generator(params, self.device)
        self._context = list(context) if params.repetition_penalty != 1.0 else []
        self._seen: torch.Tensor | None = None  # (V,) bool: tokens of the conversation before the reply
        self.counts: torch.Tensor | None = None  # (V,) float32: each token's count in the reply so far

    def state(self, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(seen (V,) bool: in the conversation or the reply, counts (V,) float32: in the reply)."""
        if self.counts is None or self.counts.shape[0] != vocab:
            self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
            self._seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            ids = [t for t in self._context if 0 <= t < vocab]
            if ids:
                self._seen[torch.tensor(ids, dtype=torch.long, device=device)] = True
        return self._seen | (self.counts > 0), self.counts

    def add(self, token: torch.Tensor) -> None:
        """Count a drawn token (a 0-d device tensor: no wait for the device here)."""
        if self.counts is not None:
            self.counts[token] += 1


def _make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.greedy or params.seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed)
    return gen


def plain_sampler(device: torch.device | str = "cpu") -> TokenSampler:
    """Greedy decoding of the raw logits: a sampler that keeps no state."""
    return TokenSampler(SamplingParams(), torch.device(device))


def sample_batch(logits: torch.Tensor, samplers: list[TokenSampler]) -> list[int]:
    """One token per row of logits (S, V), row i drawn with ``samplers[i]``, with one device-to-host
    transfer for the whole batch (``tolist`` at the end; nothing before it waits for the device)."""
    if all(s.params.plain for s in samplers):
        return torch.argmax(logits, dim=-1).tolist()
    scores = logits.float().clone()
    penalized = [i for i, s in enumerate(samplers) if s.params.penalized]
    if penalized:
        scores[penalized] = penalize(scores[penalized], [samplers[i] for i in penalized])
    picks = torch.argmax(scores, dim=-1)
    sampled = [i for i, s in enumerate(samplers) if not s.params.greedy]
    if sampled:
        probs = distribution(scores[sampled], [samplers[i].params for i in sampled])
        picks[sampled] = _draw(probs, [samplers[i].generator for i in sampled])
    for i in penalized:
        samplers[i].add(picks[i])
    return picks.tolist()


def penalize(scores: torch.Tensor, samplers: list[TokenSampler]) -> torch.Tensor:
    """Rows (P, V) with each row's repetition, frequency and presence penalties applied.

    Repetition (transformers, vLLM): a token seen in the conversation or the reply has its logit divided
    by the penalty when positive, multiplied when negative. Frequency and presence (OpenAI): subtract
    ``frequency * count + presence * (count > 0)``, counted over the reply."""
    vocab, device = scores.shape[-1], scores.device
    states = [s.state(vocab, device) for s in samplers]
    seen = torch.stack([st[0] for st in states])
    counts = torch.stack([st[1] for st in states])
    column = _column(device)
    rep = column([s.params.repetition_penalty for s in samplers])
    freq = column([s.params.frequency_penalty for s in samplers])
    pres = column([s.params.presence_penalty for s in samplers])
    scores = torch.where(seen, torch.where(scores > 0, scores / rep, scores * rep), scores)
    return scores - freq * counts - pres * (counts > 0).float()


def distribution(scores: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Probabilities (T, V) after temperature, top-k, top-p and min-p, in that order (transformers'
    warpers; each later stage sees the tokens the earlier ones left)."""
    vocab, column = scores.shape[-1], _column(scores.device)
    scores = scores / column([p.temperature for p in params])
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if min(ks) < vocab:
        kth = torch.topk(scores, max(ks), dim=-1).values  # (T, kmax), descending
        index = torch.tensor([k - 1 for k in ks], device=scores.device).unsqueeze(1)
        scores = scores.masked_fill(scores < kth.gather(1, index), float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        ascending, order = torch.sort(scores, dim=-1)
        # Drop the least likely tokens while their mass is at most 1 - top_p; the top token always stays.
        drop = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - column([p.top_p for p in params])
        drop[:, -1] = False
        scores = scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if any(p.min_p > 0.0 for p in params):
        floor = column([p.min_p for p in params]) * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(probs < floor, 0.0, probs)
    return probs


def _draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of probs (T, V): the rows without a generator together, each seeded row alone."""
    picks = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    shared = [j for j, g in enumerate(generators) if g is None]
    if shared:
        picks[shared] = torch.multinomial(probs[shared], 1).squeeze(1)
    for j, generator in enumerate(generators):
        if generator is not None:
            picks[j] = torch.multinomial(probs[j], 1, generator=generator)[0]
    return picks


def _column(device: torch.device):
    return lambda values: torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)
