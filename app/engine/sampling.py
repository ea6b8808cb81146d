"""Per-request sampling settings and the token sampler (a whole batched step's rows at once, on the model thread)."""
from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from app.engine.errors import InvalidSamplingParams


class SamplingParams(BaseModel):
    """How one turn's reply is generated. temperature 0 is greedy."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    max_tokens: int | None = Field(None, ge=1, description="Cap on generated tokens (default: the server's).")
    temperature: float = Field(0.0, ge=0.0, le=5.0, description="Softmax temperature; 0 picks the argmax.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling: smallest set with this much mass.")
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


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.greedy or params.seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed)
    return gen


Sampler = tuple[SamplingParams, "torch.Generator | None"]  # what one request's next token is drawn with


def sample_batch(logits: torch.Tensor, samplers: list[Sampler]) -> list[int]:
    """One token per row of logits (S, V), row i drawn with ``samplers[i]``, with one device-to-host
    transfer for the whole batch (``tolist`` at the end; nothing before it waits for the device).

    Greedy rows take one argmax together; a sampled row draws from its own generator, exactly as it
    would alone, so a seeded session's tokens do not depend on who shares its steps."""
    greedy = [i for i, (params, _) in enumerate(samplers) if params.greedy]
    if len(greedy) == len(samplers):
        return torch.argmax(logits, dim=-1).tolist()
    picks = torch.empty(len(samplers), dtype=torch.long, device=logits.device)
    if greedy:
        picks[greedy] = torch.argmax(logits[greedy], dim=-1)
    for i, (params, generator) in enumerate(samplers):
        if not params.greedy:
            picks[i] = _draw(logits[i], params, generator)
    return picks.tolist()


def _draw(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """A token from logits (V,) at the params' temperature and top-p, as a one-element tensor."""
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep a token while the mass before it is below top_p, so the top token always stays.
        keep = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) < params.top_p
        sorted_probs = torch.where(keep, sorted_probs, 0.0)
        choice = torch.multinomial(sorted_probs, 1, generator=generator)
        return order[choice]
    return torch.multinomial(probs, 1, generator=generator)
