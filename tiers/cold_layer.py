"""The cold tokens of one layer of one session: which chunks hold them and which slots are still cold.

Bookkeeping only; the chunk bytes live in the host tier (or Redis, after a spill).
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch

from tiers.base import Chunk
from tiers.host import HostTier


@dataclass
class ChunkRef:
    chunk_id: str
    alive: torch.Tensor  # (Hkv, C) bool on the CPU: slots whose token is still cold


class ColdLayer:
    def __init__(self, session_id: str, layer: int, host: HostTier, chunk_tokens: int):
        self.session_id, self.layer, self.host, self.chunk_tokens = session_id, layer, host, chunk_tokens
        self.refs: list[ChunkRef] = []

    def __len__(self) -> int:
        """Cold slots (alive or not) in the flat layout that ``keys``/``values`` return."""
        return len(self.refs) * self.chunk_tokens

    def alive_count(self) -> int:
        return int(sum(int(r.alive[0].sum()) for r in self.refs))

    def _read(self, field: str, device: torch.device, refs: list[ChunkRef] | None = None) -> torch.Tensor:
        parts = [getattr(self.host.get((self.session_id, r.chunk_id)), field) for r in (refs or self.refs)]
        return torch.cat(parts, dim=1).to(device, non_blocking=True)

    def keys(self, device: torch.device) -> torch.Tensor:
        """All cold slots' keys (Hkv, N, d) in the flat layout (dead slots included; see ``alive``)."""
        return self._read("keys", device)

    def values(self, device: torch.device) -> torch.Tensor:
        return self._read("values", device)

    def positions(self, device: torch.device) -> torch.Tensor:
        return self._read("positions", device)

    def alive(self, device: torch.device) -> torch.Tensor:
        return torch.cat([r.alive for r in self.refs], dim=1).to(device)

    def values_at(self, idx: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Values at flat cold indices idx (Hkv, m), reading only the chunks that hold them."""
        c = self.chunk_tokens
        needed = torch.unique(idx // c).tolist()
        remap = torch.full((len(self.refs),), -1, dtype=torch.long)
        remap[needed] = torch.arange(len(needed))
        vals = self._read("values", device, [self.refs[i] for i in needed])
        local = (remap.to(idx.device)[idx // c] * c + idx % c).clamp_min(0)
        return torch.gather(vals, 1, local.unsqueeze(-1).expand(-1, -1, vals.shape[-1]))

    def add(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> int:
        """Demote the tokens where mask (Hkv, L) is set, keeping their order; returns tokens per head (max)."""
        counts = mask.sum(1)
        n = int(counts.max()) if counts.numel() else 0
        if n == 0:
            return 0
        order = torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices[:, :n]
        alive = torch.arange(n, device=mask.device).unsqueeze(0) < counts.unsqueeze(1)
        d = keys.shape[-1]
        k = torch.gather(keys, 1, order.unsqueeze(-1).expand(-1, -1, d))
        v = torch.gather(values, 1, order.unsqueeze(-1).expand(-1, -1, d))
        pos = torch.gather(positions, 1, order)
        self._write(k, v, pos, alive)
        return n

    def _write(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, alive: torch.Tensor) -> None:
        c, n = self.chunk_tokens, k.shape[1]
        pad = (-n) % c
        if pad:
            k = torch.cat([k, k.new_zeros(k.shape[0], pad, k.shape[2])], dim=1)
            v = torch.cat([v, v.new_zeros(v.shape[0], pad, v.shape[2])], dim=1)
            pos = torch.cat([pos, pos.new_full((pos.shape[0], pad), -1)], dim=1)
            alive = torch.cat([alive, alive.new_zeros(alive.shape[0], pad)], dim=1)
        k, v, pos, alive = k.cpu(), v.cpu(), pos.cpu(), alive.cpu()
        for start in range(0, n + pad, c):
            chunk_id = f"l{self.layer}-{secrets.token_hex(6)}"
            sl = slice(start, start + c)
            self.host.put((self.session_id, chunk_id), Chunk(k[:, sl], v[:, sl], pos[:, sl]))
            self.refs.append(ChunkRef(chunk_id, alive[:, sl].clone()))

    def kill(self, mask: torch.Tensor) -> None:
        """Mark flat cold slots (Hkv, N) as promoted; chunks with nothing cold left are freed."""
        mask = mask.cpu()
        c = self.chunk_tokens
        kept = []
        for i, ref in enumerate(self.refs):
            ref.alive &= ~mask[:, i * c : (i + 1) * c]
            if ref.alive.any():
                kept.append(ref)
            else:
                self.host.free((self.session_id, ref.chunk_id))
        self.refs = kept

    def compact(self, device: torch.device) -> None:
        """Rewrite the cold tokens densely once promotions have left more holes than tokens."""
        total = len(self)
        if not self.refs or total - self.alive_count() <= max(self.alive_count(), self.chunk_tokens):
            return
        alive = self.alive(device)
        k, v, pos = self.keys(device), self.values(device), self.positions(device)
        old = self.refs
        self.refs = []
        self.add(k, v, pos, alive)
        for ref in old:
            self.host.free((self.session_id, ref.chunk_id))

    def free(self) -> None:
        for ref in self.refs:
            self.host.free((self.session_id, ref.chunk_id))
        self.refs = []

    def snapshot(self) -> list[dict]:
        """JSON-able list of chunk ids and alive masks (for persistence)."""
        return [{"id": r.chunk_id, "alive": r.alive.to(torch.uint8).flatten().tolist(), "shape": list(r.alive.shape)} for r in self.refs]

    def restore(self, items: list[dict]) -> None:
        for item in items:
            alive = torch.tensor(item["alive"], dtype=torch.uint8).view(item["shape"]).bool()
            self.refs.append(ChunkRef(item["id"], alive))
            self.host.adopt((self.session_id, item["id"]))
