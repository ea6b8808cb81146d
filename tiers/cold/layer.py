"""The cold tokens of one layer of one session: per KV head, pages of P tokens and their digests.

Bookkeeping only (which page holds which position, which of its tokens are still cold, and each page's
key bounds); the page bytes live in the host tier (or Redis, after a spill). A token's keys and values
never change, so a page keeps a promoted token's copy: demoted again, the token only becomes cold again
in place, and no byte moves. Every position therefore has at most one page slot per head, and the cold
tier never holds more than the history. Shapes: Hkv KV heads, P tokens per page, d head dim.
"""
from __future__ import annotations

import torch

from tiers.base import Traffic
from tiers.codec import PageCodec
from tiers.cold import demotion, key_sketch, persist
from tiers.cold.ids import PageNamer
from tiers.cold.table import DIGEST_DTYPE, TIER_CODES, ColdResidency, Demotion, Sketched, Table, padded_indices
from tiers.host.tier import HostTier

__all__ = ["ColdLayer", "DIGEST_DTYPE", "Demotion", "Sketched", "padded_indices"]

class ColdLayer:
    """Pages of every KV head of one layer: ids and page counts per head, and padded tables (Hkv, N, .) of
    each page's positions (-1: padding), alive flags and key bounds (``DIGEST_DTYPE``), N the largest
    head's page count; a head's rows past its own count are dead. Whole tables, so that a turn reads
    digests, candidates and page rows of all heads in a few operations, not per head. With ``sketch_bits``
    each token also keeps a key sketch (``tiers.cold.key_sketch``) beside the bounds, and a value sketch of
    as many bits within its page's value bounds: what stands in for a page a turn scores by its key sketch
    but does not read (``rocketkv_mt.standin``). A ``pages`` argument or result is (Hkv, n) page indices
    per head, ascending, padded with -1."""

    def __init__(self, session_id: str, layer: int, host: HostTier, page_tokens: int, codec: PageCodec,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype, by_keys: bool = False,
                 sketch_bits: int = 0, namer: PageNamer | None = None):
        self.session_id, self.layer, self.host, self.page_tokens, self.codec = session_id, layer, host, page_tokens, codec
        self.namer = namer or PageNamer()  # the cache's page names, shared by its layers (``tiers.cold.ids``)
        self.by_keys = by_keys  # pages of similar keys (``tiers.cold.page_grouping``), else of consecutive positions
        self.sketch_bits = sketch_bits
        if sketch_bits:
            key_sketch.codes_per_byte(sketch_bits, head_dim)  # refuses what it cannot pack, before any page
        self.dtype, self.head_dim = dtype, head_dim
        self._reset(num_kv_heads)

    def _reset(self, hkv: int) -> None:
        p, d = self.page_tokens, self.head_dim
        self.ids: list[list[str]] = [[] for _ in range(hkv)]
        self._pos = Table(hkv, (p,), torch.long, fill=-1)
        self._alive = Table(hkv, (p,), torch.bool, fill=False)
        self._kmin = Table(hkv, (d,), DIGEST_DTYPE)
        self._kmax = Table(hkv, (d,), DIGEST_DTYPE)
        self._slot_of = Table(hkv, (), torch.long, fill=-1)  # (Hkv, positions): position -> page * P + offset
        self._codes = Table(hkv, (p, key_sketch.nbytes_per_token(d, self.sketch_bits)), torch.uint8)
        self._vcodes = Table(hkv, (p, key_sketch.nbytes_per_token(d, self.sketch_bits)), torch.uint8)
        width = d if self.sketch_bits else 0
        self._vmin, self._vmax = Table(hkv, (width,), DIGEST_DTYPE), Table(hkv, (width,), DIGEST_DTYPE)
        # False once a page table without value sketches was restored (written by an older version).
        self.values_sketched = True
        # What the turn under way moved (``new_turn`` clears it), for the memory map: the flat slots it
        # promoted (Hkv, m) and the positions it made cold (Hkv, L; -1: not), one entry per move.
        self._turn_promoted: list[torch.Tensor] = []
        self._turn_demoted: list[torch.Tensor] = []

    _pages = property(lambda self: max(len(ids) for ids in self.ids))  # the largest head's page count

    # --- what is cold ------------------------------------------------------------------------
    def has_pages(self) -> bool:
        return any(self.ids)

    def alive_count(self) -> int:
        """Cold tokens of the first head (every head holds the same count)."""
        return int(self._alive.buf[0].sum())

    def held_positions(self, head: int) -> torch.Tensor:
        """Positions of this head's cold tokens, ascending (for checks and tests)."""
        return self._pos.buf[head][self._alive.buf[head]].sort().values

    def live_pages(self) -> torch.Tensor:
        """The pages holding at least one cold token."""
        return padded_indices(self._alive.buf[:, : self._pages].any(dim=-1))

    def live_page_count(self, at_most: int | None = None) -> int:
        """``live_pages``' width: the most pages holding a cold token that a KV head has. With ``at_most``
        only whether it is within that is exact (a layer with no more pages in all answers without a look)."""
        if not self.has_pages():
            return 0
        if at_most is not None and self._pages <= at_most:
            return self._pages
        return int(self._alive.buf[:, : self._pages].any(dim=-1).sum(dim=1).max())

    def digests(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """(kmin, kmax) (Hkv, N, d), ``live`` (Hkv, N) and the bytes read; bounds cover promoted tokens too."""
        n = self._pages
        nbytes = 2 * sum(len(ids) for ids in self.ids) * self.head_dim * self._kmin.buf.element_size()
        live = self._alive.buf[:, :n].any(dim=-1)
        return self._kmin.buf[:, :n].to(device), self._kmax.buf[:, :n].to(device), live.to(device), nbytes

    def sketched(self, device: torch.device, pages: torch.Tensor, dtype: torch.dtype = torch.float32,
                 bounds_read: bool = False) -> Sketched:
        """The given pages' (Hkv, n) estimated keys, from their sketches and bounds (``Sketched``).
        ``bounds_read``: the turn read every page's bounds already (``digests``); only codes count here."""
        hkv, n = len(self.ids), pages.shape[1]
        pages = pages.cpu()
        rows, pos, alive = self._rows(pages)
        codes = self._codes.take(rows)
        kmin, kmax = self._kmin.take(rows), self._kmax.take(rows)
        per_page = self.page_tokens * key_sketch.nbytes_per_token(self.head_dim, self.sketch_bits)
        if not bounds_read:
            per_page += 2 * self.head_dim * kmin.element_size()
        nbytes = int((pages >= 0).sum()) * per_page
        keys = key_sketch.decode(codes.to(device), kmin.to(device), kmax.to(device), self.sketch_bits, dtype)
        return Sketched(keys.reshape(hkv, n * self.page_tokens, self.head_dim), pos.to(device), alive.to(device),
                        nbytes)

    def sketched_values(self, device: torch.device, pages: torch.Tensor) -> tuple[torch.Tensor, int] | None:
        """The given pages' (Hkv, n) estimated values (Hkv, n * P, d) float32 and bytes read; None if not sketched."""
        if not (self.sketch_bits and self.values_sketched):
            return None
        hkv, n = len(self.ids), pages.shape[1]
        pages = pages.cpu()
        rows = pages.clamp(min=0)  # a -1 page reads row 0: its slots are dead
        codes, vmin, vmax = self._vcodes.take(rows), self._vmin.take(rows), self._vmax.take(rows)
        per_page = codes[0, 0].numel() if n else 0
        nbytes = int((pages >= 0).sum()) * (per_page + 2 * self.head_dim * vmin.element_size())
        values = key_sketch.decode(codes.to(device), vmin.to(device), vmax.to(device), self.sketch_bits)
        return values.reshape(hkv, n * self.page_tokens, self.head_dim), nbytes

    def _rows(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For pages (Hkv, n) on the CPU: their table rows (Hkv, n) (a -1 page reads row 0), and their
        slots' positions and alive flags (Hkv, n * P), -1 and dead for a -1 page."""
        hkv = len(self.ids)
        cell = (pages >= 0).unsqueeze(-1)
        rows = pages.clamp(min=0)
        pos = torch.where(cell, self._pos.take(rows), -1)
        alive = self._alive.take(rows) & cell
        return rows, pos.view(hkv, -1), alive.view(hkv, -1)

    def _slots_at(self, positions: torch.Tensor) -> torch.Tensor:
        """Flat slot of each position (Hkv, L) in its head's pages (-1 where that head never made it cold)."""
        table = self._slot_of.buf
        known = (positions >= 0) & (positions < table.shape[1])
        slots = torch.gather(table, 1, torch.where(known, positions, 0))
        return torch.where(known, slots, -1)

    def _append(self, heads: torch.Tensor, ids: list[str], pos: torch.Tensor, alive: torch.Tensor,
                kmin: torch.Tensor, kmax: torch.Tensor, codes: torch.Tensor,
                vsketch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        """New pages, each after those its head holds, in order: each one's head (m,) (ascending), ids,
        positions and alive flags (m, P), bounds (m, d), sketch codes (m, P, c), and the value sketch: codes
        (m, P, c) and bounds (m, d) twice (c, d = 0 without a sketch). One indexed copy a table, all heads."""
        p = self.page_tokens
        counts = torch.bincount(heads, minlength=len(self.ids))
        held = torch.tensor([len(ids) for ids in self.ids])
        rows = held[heads] + torch.arange(heads.numel()) - (torch.cumsum(counts, 0) - counts)[heads]
        last = int((held + counts).max())
        tables = ((self._pos, pos), (self._alive, alive), (self._kmin, kmin), (self._kmax, kmax), (self._codes, codes),
                  (self._vcodes, vsketch[0]), (self._vmin, vsketch[1]), (self._vmax, vsketch[2]))
        for table, values in tables:
            table.ensure(last)
            table.buf[heads, rows] = values
        # Each real position's flat slot in its head's pages.
        real = pos >= 0
        flat = (rows.unsqueeze(1) * p + torch.arange(p)).expand_as(pos)
        self._slot_of.ensure(int(pos.max()) + 1 if pos.numel() else 0)
        self._slot_of.buf[heads.unsqueeze(1).expand_as(pos)[real], pos[real]] = flat[real]
        start = 0
        for h, n in enumerate(counts.tolist()):
            self.ids[h] += ids[start : start + n]
            start += n

    def _mark(self, slots: torch.Tensor, cold: bool) -> None:
        """Set the alive flag of flat slots (Hkv, L) (-1: none) to ``cold``."""
        per_head = self._alive.buf.shape[1] * self.page_tokens
        flat = torch.arange(slots.shape[0]).unsqueeze(1) * per_head + slots
        self._alive.buf.view(-1)[flat[slots >= 0]] = cold

    # --- moves -------------------------------------------------------------------------------
    def demote(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> int:
        """Make cold the tokens where mask (Hkv, L) is set (``stage_demotion``, ``commit``): the bytes written."""
        staged = self.stage_demotion(keys, values, positions, mask)
        self.commit(staged)
        return staged.written

    def stage_demotion(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                       mask: torch.Tensor) -> Demotion:
        """Write the new pages of a demotion of the tokens where mask (Hkv, L) is set, for ``commit``; a
        write that fails leaves this layer unchanged (``tiers.cold.demotion.stage``)."""
        return demotion.stage(self, keys, values, positions, mask)

    def commit(self, staged: Demotion) -> None:
        """Enter a staged demotion: its tokens are cold from now on. Table updates only, nothing that waits
        on a tier; should one fail, the new pages are freed and the caller must not use the layer again."""
        self._turn_demoted.append(staged.demoted)
        self._mark(staged.again, cold=True)
        if staged.pages is None:
            return
        page_head, pos, kmin, kmax, codes, vsketch = staged.pages
        try:
            self._append(page_head, staged.ids, pos, pos >= 0, kmin, kmax, codes, vsketch)
        except BaseException:
            self.host.free_many(self.session_id, staged.ids)
            raise

    def promote(self, slots: torch.Tensor) -> None:
        """Mark flat cold slots (Hkv, m) (-1: none) as held on the device again."""
        slots = slots.cpu()
        self._turn_promoted.append(slots)
        self._mark(slots, cold=False)

    # --- the memory map ----------------------------------------------------------------------
    def new_turn(self) -> None:
        """A turn begins: what the last one promoted and demoted is forgotten."""
        self._turn_promoted, self._turn_demoted = [], []

    def residency(self) -> ColdResidency:
        """Each head's cold positions, the tier of each one's page (one look-up in the host tier for
        all pages), and the positions the turn under way (or the last) promoted and demoted."""
        hkv, p = len(self.ids), self.page_tokens
        where = self.host.where_many(self.session_id, self.page_ids())
        codes = torch.tensor([TIER_CODES[w] for w in where], dtype=torch.int8)
        positions, tiers, first = [], [], 0
        for h, ids in enumerate(self.ids):
            n = len(ids)
            alive, pos = self._alive.buf[h, :n], self._pos.buf[h, :n]
            page_of = torch.arange(n).unsqueeze(1).expand(n, p)[alive]
            positions.append(pos[alive])
            tiers.append(codes[first + page_of])
            first += n
        slot_pos = self._pos.buf.reshape(hkv, -1)
        promoted = [[] for _ in range(hkv)]
        for slots in self._turn_promoted:
            for h in range(hkv):
                row = slots[h][slots[h] >= 0]
                promoted[h].append(slot_pos[h, row])
        demoted = [[d[h][d[h] >= 0] for d in self._turn_demoted] for h in range(hkv)]
        empty = torch.zeros(0, dtype=torch.long)
        return ColdResidency(positions, tiers, [torch.cat([empty, *ps]) for ps in promoted],
                             [torch.cat([empty, *ds]) for ds in demoted])

    def fetch(self, pages: torch.Tensor, device: torch.device, traffic: Traffic):
        """Read the given pages (Hkv, n) (one batched read) -> keys, values (Hkv, n * P, d), positions,
        alive, flat slots (Hkv, n * P); a head's -1 entries become dead slots."""
        p, d, hkv, n = self.page_tokens, self.head_dim, len(self.ids), pages.shape[1]
        pages = pages.cpu()
        ids = [self.ids[i][j] for i, row in enumerate(pages.tolist()) for j in row if j >= 0]
        if not ids:
            empty = torch.zeros(hkv, 0, d, dtype=self.dtype, device=device)
            none = torch.zeros(hkv, 0, dtype=torch.long, device=device)
            return empty, empty.clone(), none, none.bool(), none.clone()
        batch, from_redis = self.host.read_many(self.session_id, ids)
        traffic.cold_bytes_read += len(ids) * self.host.page_bytes
        traffic.redis_bytes_read += from_redis
        k, v = self.codec.decode({name: t.to(device, non_blocking=True) for name, t in batch.items()}, self.dtype)
        valid = pages >= 0
        if len(ids) != hkv * n:  # heads with fewer pages: theirs in order, dead pages after them
            where = valid.flatten().to(device)
            full_k, full_v = k.new_zeros(hkv * n, p, d), v.new_zeros(hkv * n, p, d)
            full_k[where], full_v[where] = k, v
            k, v = full_k, full_v
        rows, pos, alive = self._rows(pages)
        slots = torch.where(valid.unsqueeze(-1), rows.unsqueeze(-1) * p + torch.arange(p), -1)
        # Pages come head by head, so (Hkv * n, P, d) is (Hkv, n * P, d) already.
        return (k.reshape(hkv, n * p, d), v.reshape(hkv, n * p, d), pos.to(device), alive.to(device),
                slots.view(hkv, -1).to(device))

    def free(self) -> None:
        self.host.free_many(self.session_id, self.page_ids())
        self._reset(len(self.ids))

    def clear(self) -> None:
        """Forget the page table alone (a restore that did not complete: no page was taken on)."""
        self._reset(len(self.ids))

    # --- persistence -------------------------------------------------------------------------
    def page_ids(self) -> list[str]:
        return [pid for ids in self.ids for pid in ids]

    def index_tensors(self) -> dict[str, torch.Tensor]:
        return persist.index_tensors(self)

    def snapshot(self) -> dict:
        return persist.snapshot(self)

    def restore(self, state: dict, tensors: dict[str, torch.Tensor]) -> list[str]:
        """Rebuild the page table (``tiers.cold.persist.restore``); the page ids it names."""
        return persist.restore(self, state, tensors)

    def held_per_head(self) -> list[torch.Tensor]:
        """Each head's cold positions (unsorted), for checking a restore against its history."""
        return [self._pos.buf[h, : len(ids)][self._alive.buf[h, : len(ids)]] for h, ids in enumerate(self.ids)]

