"""The cold tokens of one layer of one session: per KV head, pages of P tokens and their digests.

Bookkeeping only (which page holds which position, which of its tokens are still cold, and each
page's key bounds); the page bytes live in the host tier (or Redis, after a spill). A token's keys
and values never change, so a page keeps a promoted token's copy: when that token is demoted again
it only becomes cold again in place, and no byte moves. Every position therefore has at most one
page slot per head, and the cold tier never holds more than the history.

Shapes: Hkv KV heads, P tokens per page, d head dim, N pages of one head.
"""
from __future__ import annotations

import secrets

import torch

from tiers.base import Traffic
from tiers.codec import PageCodec
from tiers.host import HostTier
from tiers.page_grouping import group_by_keys

# Digests are read every turn, so they are kept small: bfloat16, each bound rounded away from the keys
# (kmin down, kmax up), which keeps it a bound of every key of its page.
DIGEST_DTYPE = torch.bfloat16


def outward(x: torch.Tensor, up: bool) -> torch.Tensor:
    """x in ``DIGEST_DTYPE``, rounded up (``up``) or down so that it still bounds x."""
    r = x.to(DIGEST_DTYPE)
    past = r.float() < x.float() if up else r.float() > x.float()
    return torch.where(past, torch.nextafter(r, torch.full_like(r, float("inf") if up else float("-inf"))), r)


class _Rows:
    """A tensor that grows along its first axis (amortised appends)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, fill=0):
        self.fill = fill
        self._buf = torch.full((16, *shape), fill, dtype=dtype)
        self.length = 0

    @property
    def data(self) -> torch.Tensor:
        return self._buf[: self.length]

    def append(self, rows: torch.Tensor) -> None:
        need = self.length + rows.shape[0]
        if need > self._buf.shape[0]:
            grown = torch.full((max(need, 2 * self._buf.shape[0]), *self._buf.shape[1:]), self.fill, dtype=self._buf.dtype)
            grown[: self.length] = self.data
            self._buf = grown
        self._buf[self.length : need] = rows
        self.length = need

    def set(self, rows: torch.Tensor) -> None:
        self.length = 0
        self.append(rows)


class HeadPages:
    """Pages of one KV head: ids, positions (N, P) int64 (-1: padding), alive (N, P), key bounds (N, d)
    in ``DIGEST_DTYPE``."""

    def __init__(self, page_tokens: int, head_dim: int):
        self.ids: list[str] = []
        self.pos = _Rows((page_tokens,), torch.long, fill=-1)
        self.alive = _Rows((page_tokens,), torch.bool, fill=False)
        self.kmin = _Rows((head_dim,), DIGEST_DTYPE)
        self.kmax = _Rows((head_dim,), DIGEST_DTYPE)
        self.slot_of = torch.full((0,), -1, dtype=torch.long)  # position -> flat slot (page * P + offset)

    def index_positions(self, first_page: int) -> None:
        """Record the flat slots of the pages from ``first_page`` on in ``slot_of``."""
        pos = self.pos.data[first_page:].flatten()
        flat = torch.arange(first_page * self.pos.data.shape[1], self.pos.length * self.pos.data.shape[1])
        real = pos >= 0
        top = int(pos.max()) + 1 if pos.numel() else 0
        if top > self.slot_of.shape[0]:
            grown = torch.full((max(top, 2 * self.slot_of.shape[0]),), -1, dtype=torch.long)
            grown[: self.slot_of.shape[0]] = self.slot_of
            self.slot_of = grown
        self.slot_of[pos[real]] = flat[real]

    def slots_of(self, positions: torch.Tensor) -> torch.Tensor:
        """Flat slot of each position (-1 where this head never made it cold)."""
        out = torch.full_like(positions, -1)
        known = positions < self.slot_of.shape[0]
        out[known] = self.slot_of[positions[known]]
        return out


class ColdLayer:
    def __init__(self, session_id: str, layer: int, host: HostTier, page_tokens: int, codec: PageCodec,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype, by_keys: bool = False):
        self.session_id, self.layer, self.host, self.page_tokens, self.codec = session_id, layer, host, page_tokens, codec
        self.by_keys = by_keys  # pages of similar keys (``page_grouping``), else of consecutive positions
        self.dtype = dtype
        self.epoch = secrets.token_hex(4)  # page ids are unique per cache, across processes and rebuilds
        self.heads = [HeadPages(page_tokens, head_dim) for _ in range(num_kv_heads)]
        self._made = 0

    # --- what is cold ------------------------------------------------------------------------
    def has_pages(self) -> bool:
        return any(h.ids for h in self.heads)

    def alive_count(self) -> int:
        """Cold tokens of the first head (every head holds the same count)."""
        return int(self.heads[0].alive.data.sum())

    def held_positions(self, head: int) -> torch.Tensor:
        """Positions of this head's cold tokens, ascending (for checks and tests)."""
        h = self.heads[head]
        return h.pos.data[h.alive.data].sort().values

    def live_pages(self) -> list[torch.Tensor]:
        """Per head, the indices of pages holding at least one cold token."""
        return [torch.nonzero(h.alive.data.any(dim=1)).flatten() for h in self.heads]

    def digests(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """(kmin, kmax) (Hkv, N, d) padded to the largest head, ``live`` (Hkv, N) and the bytes read.

        A page's bounds cover all its tokens, promoted ones too: still an upper bound of its cold ones."""
        n = max(h.kmin.length for h in self.heads)
        d = self.heads[0].kmin.data.shape[1]
        kmin = torch.zeros(len(self.heads), n, d, dtype=DIGEST_DTYPE)
        kmax = torch.zeros_like(kmin)
        live = torch.zeros(len(self.heads), n, dtype=torch.bool)
        for i, h in enumerate(self.heads):
            kmin[i, : h.kmin.length] = h.kmin.data
            kmax[i, : h.kmax.length] = h.kmax.data
            live[i, : h.alive.length] = h.alive.data.any(dim=1)
        nbytes = 2 * sum(h.kmin.data.numel() for h in self.heads) * kmin.element_size()
        return kmin.to(device), kmax.to(device), live.to(device), nbytes

    # --- moves -------------------------------------------------------------------------------
    def demote(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> int:
        """Make cold the tokens where mask (Hkv, L) is set; returns the page bytes written.

        keys/values (Hkv, L, d), positions (Hkv, L). Tokens that already have a page slot (promoted
        earlier) become cold again in place; the others are written to new pages, in position order or,
        with ``by_keys``, grouped by their keys (``tiers.page_grouping``)."""
        p, d = self.page_tokens, keys.shape[-1]
        mask, pos_cpu = mask.cpu(), positions.cpu()
        fresh_of = []  # per head: the store slots of its tokens that need new page slots
        for i, h in enumerate(self.heads):
            pos = pos_cpu[i][mask[i]]
            if pos.numel() == 0:
                fresh_of.append(torch.zeros(0, dtype=torch.long))
                continue
            slots = h.slots_of(pos)
            again = slots >= 0
            if again.any():
                h.alive.data.view(-1)[slots[again]] = True
            fresh_of.append(torch.nonzero(mask[i]).flatten()[~again])
        if self.by_keys and any(f.numel() > p for f in fresh_of):
            fresh_of = self._grouped(keys, fresh_of)
        new_k, new_v, new_pos, owners = [], [], [], []
        for i, fresh in enumerate(fresh_of):
            if fresh.numel() == 0:
                continue
            pages = -(-fresh.numel() // p)
            pad = pages * p - fresh.numel()
            idx = fresh.to(keys.device)
            k, v = keys[i].index_select(0, idx), values[i].index_select(0, idx)
            fpos = pos_cpu[i].index_select(0, fresh)
            if pad:
                k = torch.cat([k, k[-1:].expand(pad, d)])  # a copy of the last key keeps the page's bounds
                v = torch.cat([v, v.new_zeros(pad, d)])
                fpos = torch.cat([fpos, fpos.new_full((pad,), -1)])
            new_k.append(k.view(pages, p, d))
            new_v.append(v.view(pages, p, d))
            new_pos.append(fpos.view(pages, p))
            owners += [i] * pages
        if not owners:
            return 0
        k, v = torch.cat(new_k), torch.cat(new_v)
        ids = [f"l{self.layer}-{self.epoch}-{self._made + j}" for j in range(len(owners))]
        self._made += len(owners)
        encoded = self.codec.encode(k, v)
        written = self.host.put_many(self.session_id, ids, encoded)
        # Bounds of the keys a fetch gives back (with int8 these differ from k by up to half a step).
        stored = self.codec.decode(encoded, self.dtype)[0]
        kmin, kmax = stored.amin(dim=1).cpu(), stored.amax(dim=1).cpu()
        pos = torch.cat(new_pos)
        owner_t = torch.tensor(owners)
        for i, h in enumerate(self.heads):
            rows = torch.nonzero(owner_t == i).flatten()
            if rows.numel() == 0:
                continue
            first = h.pos.length
            h.ids += [ids[r] for r in rows.tolist()]
            h.pos.append(pos[rows])
            h.alive.append(pos[rows] >= 0)
            h.kmin.append(outward(kmin[rows], up=False))
            h.kmax.append(outward(kmax[rows], up=True))
            h.index_positions(first)
        return written

    def _grouped(self, keys: torch.Tensor, fresh_of: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each head's fresh slots reordered so that its pages hold similar keys (all heads at once)."""
        counts = [int(f.numel()) for f in fresh_of]
        picked = torch.cat([keys[i].index_select(0, f.to(keys.device)) for i, f in enumerate(fresh_of)])
        order = group_by_keys(picked, self.page_tokens, counts).cpu()
        flat = torch.cat(fresh_of)[order]
        return list(flat.split(counts))

    def promote(self, slots: torch.Tensor) -> None:
        """Mark flat cold slots (Hkv, m) (-1: none) as held on the device again."""
        slots = slots.cpu()
        for i, h in enumerate(self.heads):
            s = slots[i][slots[i] >= 0]
            if s.numel():
                h.alive.data.view(-1)[s] = False

    def fetch(self, pages: list[torch.Tensor], device: torch.device, traffic: Traffic):
        """Read the given pages of each head (one batched read) -> keys, values (Hkv, M, d), positions,
        alive, flat slots (Hkv, M), M = P times the largest page count; shorter heads are padded with
        dead slots."""
        p = self.page_tokens
        n = max((int(x.numel()) for x in pages), default=0)
        ids = [self.heads[i].ids[j] for i, x in enumerate(pages) for j in x.tolist()]
        hkv, d = len(self.heads), self.heads[0].kmin.data.shape[1]
        if not ids:
            empty = torch.zeros(hkv, 0, d, dtype=self.dtype, device=device)
            none = torch.zeros(hkv, 0, dtype=torch.long, device=device)
            return empty, empty.clone(), none, none.bool(), none.clone()
        batch, from_redis = self.host.read_many(self.session_id, ids)
        counts = [int(x.numel()) for x in pages]
        traffic.cold_bytes_read += len(ids) * self.host.page_bytes
        traffic.redis_bytes_read += from_redis
        k, v = self.codec.decode({name: t.to(device, non_blocking=True) for name, t in batch.items()}, self.dtype)
        pos = [h.pos.data[x] for h, x in zip(self.heads, pages)]
        alive = [h.alive.data[x] for h, x in zip(self.heads, pages)]
        slots = [(x.unsqueeze(1) * p + torch.arange(p)).flatten() for x in pages]
        if min(counts) != n:  # heads with fewer live pages: pad them with dead slots
            k, v = self._pad_heads(k, counts, n), self._pad_heads(v, counts, n)
            pos = [torch.cat([t, t.new_full((n - c, p), -1)]) for t, c in zip(pos, counts)]
            alive = [torch.cat([t, t.new_zeros(n - c, p)]) for t, c in zip(alive, counts)]
            slots = [torch.cat([t, t.new_full(((n - c) * p,), -1)]) for t, c in zip(slots, counts)]
        # Pages arrive head by head, so (Hkv * n, P, d) is (Hkv, n * P, d) already.
        return (k.reshape(hkv, n * p, d), v.reshape(hkv, n * p, d), torch.stack(pos).view(hkv, -1).to(device),
                torch.stack(alive).view(hkv, -1).to(device), torch.stack(slots).to(device))

    @staticmethod
    def _pad_heads(t: torch.Tensor, counts: list[int], n: int) -> torch.Tensor:
        """Pages (sum(counts), P, d), head by head -> (Hkv * n, P, d) with zero pages after each head's own."""
        out = t.new_zeros(len(counts) * n, *t.shape[1:])
        start = 0
        for i, c in enumerate(counts):
            out[i * n : i * n + c] = t[start : start + c]
            start += c
        return out

    def free(self) -> None:
        self.host.free_many(self.session_id, [pid for h in self.heads for pid in h.ids])
        d = self.heads[0].kmin.data.shape[1]
        self.heads = [HeadPages(self.page_tokens, d) for _ in self.heads]

    # --- persistence -------------------------------------------------------------------------
    def page_ids(self) -> list[str]:
        return [pid for h in self.heads for pid in h.ids]

    def index_tensors(self) -> dict[str, torch.Tensor]:
        """The page table as tensors (written to Redis with the session's record)."""
        out = {}
        for i, h in enumerate(self.heads):
            out[f"pos{i}"] = h.pos.data.to(torch.int32)
            out[f"alive{i}"] = h.alive.data
            out[f"kmin{i}"] = h.kmin.data
            out[f"kmax{i}"] = h.kmax.data
            out[f"ids{i}"] = torch.tensor([int(pid.rsplit("-", 1)[1]) for pid in h.ids], dtype=torch.int64)
        return out

    def snapshot(self) -> dict:
        """What the page table's tensors need besides themselves (JSON-able)."""
        return {"epoch": self.epoch, "made": self._made}

    def restore(self, state: dict, tensors: dict[str, torch.Tensor]) -> None:
        self.epoch, self._made = state["epoch"], int(state["made"])
        prefix = f"l{self.layer}-{self.epoch}-"
        for i, h in enumerate(self.heads):
            h.ids = [f"{prefix}{n}" for n in tensors[f"ids{i}"].tolist()]
            h.pos.set(tensors[f"pos{i}"].long())
            h.alive.set(tensors[f"alive{i}"])
            h.kmin.set(outward(tensors[f"kmin{i}"], up=False))
            h.kmax.set(outward(tensors[f"kmax{i}"], up=True))
            h.index_positions(0)
        self.host.adopt_many(self.session_id, self.page_ids())
