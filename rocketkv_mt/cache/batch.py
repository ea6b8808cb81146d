"""A batch view over several session caches, so that one model forward serves many sessions.

The sessions' new tokens are packed into one sequence: input_ids (1, T) with T = sum of the
segments' lengths, and position_ids (1, T) where each segment continues its own session's history.
A decode step of B sessions is B segments of one token; a turn's prefill is one longer segment and
can share a forward with decode segments. Embeddings, projections, MLP and the LM head run once
over all T tokens (that is the work batching shares); tokens never mix anywhere in the model but
in attention, and attention is per session: each segment goes to its own cache, which attends in
its own mode over its own kept tokens (HSA reads a fixed-size set, so a decode segment's cost does
not grow with its history).

Decode segments run together: every cache describes its layer's step (``decode_target``) and the
whole layer's decode, all sessions and modes at once (appends, KT bounds, HSA or dense attention),
is one kernel call over their separate buffers (``dispatch.decode_batch``: Triton on CUDA, the
native C kernel on a float32 CPU), so the torch ops and launches per layer do not grow with the
sessions. Prefill segments, and decode steps a cache must run alone (``decode_target`` is None), go
through the cache's own ``attend``; so does everything when no batched kernel can run here.

A cache that raises is isolated: its segment gets zeros from then on, the exception is kept in
``errors`` and the other segments go on, exactly as if they had run alone. The failed cache is
half-way through a step and must be discarded by its owner. A failure of the batched kernel call
itself is not any one cache's: it propagates, like a failure of the model.
"""
from __future__ import annotations

import numpy as np
import torch

from rocketkv_mt import dispatch
from rocketkv_mt.cache.base import SessionCache
from rocketkv_mt.cache.decode_target import DecodeTarget
from rocketkv_mt.decode_table import WIDTH


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
        # Decode segments that may join the layer's batched step (timed caches keep their own path).
        self.decoding = [
            i for i, (c, n) in enumerate(zip(self.caches, self.lengths))
            if n == 1 and c.step is not None and not c.step.prefill and not c.timer.enabled
        ]
        self._staging: torch.Tensor | None = None  # pinned host copy of every layer's table (CUDA)
        self._index: dict[tuple[int, ...], torch.Tensor] = {}

    def positions(self) -> torch.Tensor:
        """(1, T): each segment's positions continue its own session's history."""
        if self.total == len(self.caches):  # one token each: one tensor, not one per session
            return torch.tensor([[c.history_len for c in self.caches]], device=self.caches[0].spec.device)
        return torch.cat([c.positions(n) for c, n in zip(self.caches, self.lengths)]).unsqueeze(0)

    def last_indices(self, device: torch.device) -> torch.Tensor:
        """Index in the packed sequence of each segment's last token (whose logits are wanted)."""
        return torch.tensor([stop - 1 for _, stop in self.bounds], dtype=torch.long, device=device)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
        """q (1, Hq, T, d), k/v (1, Hkv, T, d) -> (1, T, Hq, d), segment i attended by ``caches[i]``."""
        _, hq, t, d = q.shape
        if t != self.total:
            raise ValueError(f"{t} packed tokens for segments totalling {self.total}")
        kind = dispatch.decode_batch_kind(self.caches[0].spec.kernels, q) if self.decoding else None
        targets = self._targets(layer) if kind is not None else []
        if not targets:
            if len(self.caches) == 1:
                return self._one(0, layer, q, k, v, scaling)
            return torch.cat([self._one(i, layer, q, k, v, scaling) for i in range(len(self.caches))], dim=1)
        batched, targets = self._run_batched(layer, kind, targets, q, k, v, scaling)  # (B, Hq, d)
        if len(targets) == len(self.caches):
            return batched.unsqueeze(0)
        out = q.new_zeros(1, t, hq, d)
        out[0].index_copy_(0, self._token_index([self.bounds[i][0] for i, _ in targets], q.device), batched)
        done = {i for i, _ in targets}
        for i in range(len(self.caches)):
            if i not in done:
                start, stop = self.bounds[i]
                out[:, start:stop] = self._one(i, layer, q, k, v, scaling)
        return out

    def _targets(self, layer: int) -> list[tuple[int, DecodeTarget]]:
        """(segment, its step) of the decode segments whose caches can join this layer's batched step."""
        targets = []
        for i in self.decoding:
            if i in self.errors:
                continue
            try:
                target = self.caches[i].decode_target(layer)
            except Exception as exc:  # noqa: BLE001 - isolated and reported per segment
                self.errors[i] = exc
                continue
            if target is not None:
                targets.append((i, target))
        return targets

    def _run_batched(
        self, layer: int, kind: str, targets: list[tuple[int, DecodeTarget]], q, k, v, scaling: float
    ) -> tuple[torch.Tensor, list[tuple[int, DecodeTarget]]]:
        """The batched decode step of ``targets`` -> (out (B, Hq, d), the B targets it ran): a target
        whose cache fails while its row is made is left out (and its segment isolated)."""
        rows, kept = [], []
        for i, target in targets:
            try:
                rows.append(target.row(self.caches[i].history_len))
                kept.append((i, target))
            except Exception as exc:  # noqa: BLE001 - isolated and reported per segment
                self.errors[i] = exc
        if not kept:
            return q.new_zeros(0, q.shape[1], q.shape[3]), kept
        hq, d = q.shape[1], q.shape[3]
        hkv = k.shape[1]
        tokens = [self.bounds[i][0] for i, _ in kept]
        if len(tokens) == self.total:  # every token is a batched decode token: views, no gather
            qb, kb, vb = q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1)
        else:
            index = self._token_index(tokens, q.device)
            qb, kb, vb = (x[0].index_select(1, index).transpose(0, 1) for x in (q, k, v))
        table = np.asarray(rows, dtype=np.int64)
        device_table = self._device_table(layer, table) if kind == "triton" and q.is_cuda else None
        out = dispatch.decode_batch(
            table, qb.reshape(len(kept), hkv, hq // hkv, d), kb, vb, scaling, kind=kind, table=device_table
        )
        for _, target in kept:
            target.commit()
        return out.view(len(kept), hq, d), kept

    def _device_table(self, layer: int, table: np.ndarray) -> torch.Tensor:
        """The layer's rows on the GPU, copied from pinned memory without stalling the stream: one
        pinned buffer per step, a region per layer, so no copy still in flight is overwritten."""
        n = table.shape[0]
        layers = self.caches[0].spec.num_layers
        if self._staging is None or self._staging.shape[1] < n:
            self._staging = torch.empty(layers, len(self.caches), WIDTH, dtype=torch.int64, pin_memory=True)
        host = self._staging[layer, :n]
        host.numpy()[:] = table
        return host.to(self.caches[0].spec.device, non_blocking=True)

    def _token_index(self, tokens: list[int], device: torch.device) -> torch.Tensor:
        key = tuple(tokens)
        if key not in self._index:
            self._index[key] = torch.tensor(tokens, dtype=torch.long, device=device)
        return self._index[key]

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
