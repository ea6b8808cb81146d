"""RocketKV configuration: one knob (the token budget) and the sizes the paper derives from it."""
from __future__ import annotations

import math
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field


@dataclass(frozen=True)
class BudgetSplit:
    """Concrete sizes for one turn, derived from the budget and the sequence length.

    prompt_budget: tokens per KV head that Stage 1 keeps (window included).
    page_size: tokens per KT page.  topr: head-dim channels HSA scores with.
    topk: tokens' worth of pages HSA attends to at each decode step.
    local_window: most recent kept tokens whose pages HSA always attends, within topk.
    anchor_tokens: tokens' worth of the pages Stage 1 scored highest this turn, pinned for its decode.
    dense_layers: the first layers, whose attention is too diffuse for top-k, decode densely over their kept set.
    """

    token_budget: int
    window_size: int
    kernel_size: int
    prompt_budget: int
    page_size: int
    topr: int
    topk: int
    local_window: int = 0
    anchor_tokens: int = 0
    dense_layers: int = 0

    def window_of(self, q):
        """The observation window of a turn's queries q (Hq, n, d): its last min(W, n) rows."""
        return q[:, -min(self.window_size, q.shape[1]) :]

    @property
    def topk_pages(self) -> int:
        return -(-self.topk // self.page_size)

    @property
    def anchor_pages(self) -> int:
        return -(-self.anchor_tokens // self.page_size)


class RocketKVConfig(BaseModel):
    """The paper's split of one token budget t (docs/design.md, "The budget split"); any derived field may be set explicitly.

    With S = prompt length + max new tokens and c = S / t:
    alpha = min(0.2 + 0.06 log2 c, 0.8); capacity = S / c^alpha (at least min(2 max_new, S));
    prompt_budget = capacity - max_new; c2 = capacity / t; page_size = min(floor(c2), ceil(sqrt(c2)));
    topr = round(d page_size / c2); topk = t / 2 tokens.
    """

    model_config = ConfigDict(extra="forbid")

    token_budget: int = Field(256, ge=2, description="Token budget t: tokens' worth of KV read per decode step.")
    window_size: int = Field(32, ge=1, description="Observation window W: last prompt queries that score tokens.")
    kernel_size: int = Field(63, ge=1, description="Max-pool kernel that smooths Stage-1 scores (odd).")
    prompt_budget: int | None = Field(None, ge=1, description="Tokens kept per KV head by Stage 1.")
    page_size: int | None = Field(None, ge=1, description="Tokens per KT page.")
    topr: int | None = Field(None, ge=1, description="Head-dim channels used for approximate page scores.")
    topk: int | None = Field(None, ge=1, description="Tokens' worth of pages attended at each decode step.")
    local_window: int | None = Field(
        None,
        ge=0,
        description="Most recent kept tokens whose pages HSA always attends, counted within topk "
        "(default: window_size, capped at topk / 2; 0 = the paper's pure top-k).",
    )
    anchor_tokens: int = Field(
        0,
        ge=0,
        description="Tokens' worth of the pages the turn's observation window scored highest, always attended "
        "at that turn's decode, counted within topk (0 = off: measured, topk / 4 lost a needle case and "
        "changed no multi-turn answer on the bundled model).",
    )
    dense_layers: int = Field(
        0,
        ge=0,
        description="The first N layers decode densely over their kept (Stage-1) set instead of HSA "
        "(0 = the paper: HSA in every layer).",
    )

    def split(self, seq_len: int, max_new: int, head_dim: int) -> BudgetSplit:
        """Sizes for a sequence of ``seq_len`` tokens (history + prompt + max_new) and head dim ``head_dim``."""
        s = max(int(seq_len), 1)
        max_new = max(0, min(int(max_new), s - 1))
        t = min(self.token_budget, s)
        c = max(1.0, s / t)
        alpha = min(0.2 + 0.06 * math.log2(c), 0.8)
        capacity = max(int(s / c**alpha), min(2 * max_new, s))
        c2 = max(1.0, capacity / t)
        page = self.page_size or max(1, min(math.floor(c2), math.ceil(math.sqrt(c2))))
        topr = self.topr or min(head_dim, max(1, round(head_dim * page / c2)))
        prompt_budget = self.prompt_budget or max(self.window_size + 1, min(s - max_new, capacity - max_new))
        topk = self.topk or max(1, min(round(t / 2), capacity))
        local = min(self.window_size if self.local_window is None else self.local_window, topk // 2)
        return BudgetSplit(
            token_budget=self.token_budget,
            window_size=self.window_size,
            kernel_size=self.kernel_size,
            prompt_budget=prompt_budget,
            page_size=page,
            topr=min(topr, head_dim),
            topk=topk,
            local_window=local,
            anchor_tokens=min(self.anchor_tokens, topk - local),
            dense_layers=self.dense_layers,
        )
