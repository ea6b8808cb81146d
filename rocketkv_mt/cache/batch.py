"""A batch view over several session caches, so that one model forward serves many sessions.

The sessions' new tokens are packed into one sequence: input_ids (1, T) with T = sum of the
segments' lengths, and position_ids (1, T) where each segment continues its own session's history.
A decode step of B sessions is B segments of one token; a turn's prefill is one longer segment and
can share a forward with decode segments. Embeddings, projections, MLP and the LM head run once
over all T tokens (that is the work batching shares); tokens never mix anywhere in the model but
in attention, and attention is per session: each segment goes to its own cache, which attends in
its own mode over its own kept tokens (HSA reads a fixed-size set, so a decode segment's cost does
not grow with its history).

A cache that raises is isolated: its segment gets zeros from then on, the exception is kept in
``errors`` and the other segments go on, exactly as if they had run alone. The failed cache is
half-way through a step and must be discarded by its owner.
"""
from __future__ import annotations

import torch

from rocketkv_mt.cache.base import SessionCache


class BatchCache:
    """``caches[i]`` serves the i-th segment, of ``lengths[i]`` tokens; every cache must be between
    ``begin_forward`` and ``end_forward`` for exactly that many tokens."""

    def __init__(self, caches: list[SessionCache], lengths: list[int]):
        if not caches or len(caches) != len(lengths) or min(lengths) < 1:
            raise ValueError("a batch needs one or more caches, each with a segment of at least one token")
        self.caches = list(caches)
        self.lengths = list(lengths)
        self.bounds = []
        start = 0
        for n in self.lengths:
            self.bounds.append((start, start + n))
            start += n
        self.total = start
        self.errors: dict[int, BaseException] = {}

    def positions(self) -> torch.Tensor:
        """(1, T): each segment's positions continue its own session's history."""
        return torch.cat([c.positions(n) for c, n in zip(self.caches, self.lengths)]).unsqueeze(0)

    def last_indices(self, device: torch.device) -> torch.Tensor:
        """Index in the packed sequence of each segment's last token (whose logits are wanted)."""
        return torch.tensor([stop - 1 for _, stop in self.bounds], dtype=torch.long, device=device)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
        """q (1, Hq, T, d), k/v (1, Hkv, T, d) -> (1, T, Hq, d), segment i attended by ``caches[i]``."""
        _, hq, t, d = q.shape
        if t != self.total:
            raise ValueError(f"{t} packed tokens for segments totalling {self.total}")
        if len(self.caches) == 1:
            return self._one(0, layer, q, k, v, scaling)
        return torch.cat([self._one(i, layer, q, k, v, scaling) for i in range(len(self.caches))], dim=1)

    def _one(self, i: int, layer: int, q, k, v, scaling: float) -> torch.Tensor:
        start, stop = self.bounds[i]
        if i not in self.errors:
            try:
                if len(self.caches) == 1:
                    return self.caches[i].attend(layer, q, k, v, scaling)
                return self.caches[i].attend(
                    layer, q[:, :, start:stop], k[:, :, start:stop], v[:, :, start:stop], scaling
                )
            except Exception as exc:  # noqa: BLE001 - isolated and reported per segment
                self.errors[i] = exc
        return q.new_zeros(1, stop - start, q.shape[1], q.shape[3])
