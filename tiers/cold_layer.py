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
from dataclasses import dataclass, field

import torch

from tiers import key_sketch
from tiers.base import Traffic
from tiers.codec import PageCodec
from tiers.host import HostTier
from tiers.page_grouping import group_by_keys
from tiers.residency import TIER_CODES, ColdResidency

# Digests are read every turn, so they are kept small: bfloat16, each bound rounded away from the keys
# (kmin down, kmax up), which keeps it a bound of every key of its page.
DIGEST_DTYPE = torch.bfloat16


def outward(x: torch.Tensor, up: bool) -> torch.Tensor:
    """x in ``DIGEST_DTYPE``, rounded up (``up``) or down so that it still bounds x."""
    r = x.to(DIGEST_DTYPE)
    past = r.float() < x.float() if up else r.float() > x.float()
    return torch.where(past, torch.nextafter(r, torch.full_like(r, float("inf") if up else float("-inf"))), r)


class _Table:
    """Rows of every KV head in one tensor (Hkv, capacity, *row), grown along its second axis (pages,
    or positions); rows past what a head holds are ``fill``."""

    def __init__(self, heads: int, row: tuple[int, ...], dtype: torch.dtype, fill=0):
        self.fill = fill
        self.buf = torch.full((heads, 16, *row), fill, dtype=dtype)

    def ensure(self, pages: int) -> None:
        have = self.buf.shape[1]
        if pages > have:
            grown = torch.full((self.buf.shape[0], max(pages, 2 * have), *self.buf.shape[2:]), self.fill,
                               dtype=self.buf.dtype)
            grown[:, :have] = self.buf
            self.buf = grown

    def take(self, pages: torch.Tensor) -> torch.Tensor:
        """Each head's rows at its pages (Hkv, n) (every entry a row, >= 0): (Hkv, n, *row). One
        ``index_select`` over the heads' rows laid end to end: a broadcast (head, page) index costs
        5-20x more on a CPU (0.6 ms against 32 us for a 260-page pool's codes)."""
        heads, capacity = self.buf.shape[:2]
        flat = (torch.arange(heads).unsqueeze(1) * capacity + pages).flatten()
        return self.buf.flatten(0, 1).index_select(0, flat).view(heads, pages.shape[1], *self.buf.shape[2:])


@dataclass
class Sketched:
    """A pool of cold pages (Hkv, n) as their sketches give them: estimated keys (Hkv, n * P, d), their
    positions and alive flags (Hkv, n * P; a -1 page's slots are dead), and the bytes read for them."""

    keys: torch.Tensor
    positions: torch.Tensor
    alive: torch.Tensor
    nbytes: int


@dataclass
class Demotion:
    """A demotion written but not yet in the page table (``ColdLayer.stage_demotion``): the positions it
    makes cold (Hkv, L; -1: not), the flat slots of those cold again in place (Hkv, L; -1: none), and
    its new pages: their ids, the bytes written, and their table rows (None: no new page)."""

    demoted: torch.Tensor
    again: torch.Tensor
    ids: list[str] = field(default_factory=list)
    written: int = 0
    pages: tuple | None = None


def padded_indices(mask: torch.Tensor) -> torch.Tensor:
    """Per row of mask (H, N), the indices where it is set, ascending, then -1: (H, most set in a row)."""
    n = mask.shape[1]
    key = torch.where(mask, torch.arange(n, device=mask.device), n).sort(dim=1).values
    m = int(mask.sum(dim=1).max()) if mask.numel() else 0
    key = key[:, :m]
    return torch.where(key == n, -1, key)


class ColdLayer:
    """Pages of every KV head of one layer: ids and page counts per head, and padded tables (Hkv, N, .)
    of each page's positions (-1: padding), alive flags and key bounds (``DIGEST_DTYPE``), N the
    largest head's page count; a head's rows past its own count are dead. Held as whole tables so that
    a turn reads digests, candidates and page rows of all heads in a few operations, not per head.

    With ``sketch_bits`` each token also keeps a key sketch (``tiers.key_sketch``) beside the bounds,
    and a value sketch of as many bits within its page's value bounds: what stands in for a page a turn
    scores by its key sketch but does not read (``rocketkv_mt.standin``).

    A ``pages`` argument or result is (Hkv, n) page indices per head, ascending, padded with -1."""

    def __init__(self, session_id: str, layer: int, host: HostTier, page_tokens: int, codec: PageCodec,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype, by_keys: bool = False,
                 sketch_bits: int = 0):
        self.session_id, self.layer, self.host, self.page_tokens, self.codec = session_id, layer, host, page_tokens, codec
        self.by_keys = by_keys  # pages of similar keys (``page_grouping``), else of consecutive positions
        self.sketch_bits = sketch_bits
        if sketch_bits:
            key_sketch.codes_per_byte(sketch_bits, head_dim)  # refuses what it cannot pack, before any page
        self.dtype, self.head_dim = dtype, head_dim
        self._new_epoch()
        self._reset(num_kv_heads)

    def _new_epoch(self) -> None:
        """Page ids never repeat within a session: each cache, and each restore of one, names its new
        pages under an epoch of its own (31 random bits, so that epoch and counter pack into one int64),
        so that two copies of a session (a stale replica and the one that took over) never write
        different bytes under one name."""
        self.epoch = secrets.randbits(31)
        self._made = 0

    def _page_id(self, epoch: int, n: int) -> str:
        return page_id(self.layer, epoch, n)

    def _reset(self, hkv: int) -> None:
        p, d = self.page_tokens, self.head_dim
        self.ids: list[list[str]] = [[] for _ in range(hkv)]
        self._pos = _Table(hkv, (p,), torch.long, fill=-1)
        self._alive = _Table(hkv, (p,), torch.bool, fill=False)
        self._kmin = _Table(hkv, (d,), DIGEST_DTYPE)
        self._kmax = _Table(hkv, (d,), DIGEST_DTYPE)
        self._slot_of = _Table(hkv, (), torch.long, fill=-1)  # (Hkv, positions): position -> page * P + offset
        self._codes = _Table(hkv, (p, key_sketch.nbytes_per_token(d, self.sketch_bits)), torch.uint8)
        self._vcodes = _Table(hkv, (p, key_sketch.nbytes_per_token(d, self.sketch_bits)), torch.uint8)
        width = d if self.sketch_bits else 0
        self._vmin, self._vmax = _Table(hkv, (width,), DIGEST_DTYPE), _Table(hkv, (width,), DIGEST_DTYPE)
        # False once a page table without value sketches was restored (written by an older version).
        self.values_sketched = True
        # What the turn under way moved (``new_turn`` clears it), for the memory map: the flat slots it
        # promoted (Hkv, m) and the positions it made cold (Hkv, L; -1: not), one entry per move.
        self._turn_promoted: list[torch.Tensor] = []
        self._turn_demoted: list[torch.Tensor] = []

    @property
    def _pages(self) -> int:
        return max(len(ids) for ids in self.ids)

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
        """How many pages holding a cold token the KV head with the most has (``live_pages``' width).
        Only whether it is within ``at_most`` may be asked: then a layer with no more pages in all
        says so without a look at its tokens."""
        if not self.has_pages():
            return 0
        if at_most is not None and self._pages <= at_most:
            return self._pages
        return int(self._alive.buf[:, : self._pages].any(dim=-1).sum(dim=1).max())

    def digests(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """(kmin, kmax) (Hkv, N, d), ``live`` (Hkv, N) and the bytes read.

        A page's bounds cover all its tokens, promoted ones too: still an upper bound of its cold ones."""
        n = self._pages
        nbytes = 2 * sum(len(ids) for ids in self.ids) * self.head_dim * self._kmin.buf.element_size()
        live = self._alive.buf[:, :n].any(dim=-1)
        return self._kmin.buf[:, :n].to(device), self._kmax.buf[:, :n].to(device), live.to(device), nbytes

    def sketched(self, device: torch.device, pages: torch.Tensor, dtype: torch.dtype = torch.float32,
                 bounds_read: bool = False) -> Sketched:
        """The given pages' (Hkv, n) estimated keys, from their sketches and bounds (``Sketched``).
        ``bounds_read``: the turn read every page's bounds already (``digests``), so only the codes
        count as read here."""
        hkv, n = len(self.ids), pages.shape[1]
        pages = pages.cpu()
        rows, pos, alive = self._rows(pages)
        codes = self._codes.take(rows)
        kmin, kmax = self._kmin.take(rows), self._kmax.take(rows)
        # The codes and the bounds they are steps of: both read for every page scored.
        per_page = self.page_tokens * key_sketch.nbytes_per_token(self.head_dim, self.sketch_bits)
        if not bounds_read:
            per_page += 2 * self.head_dim * kmin.element_size()
        nbytes = int((pages >= 0).sum()) * per_page
        keys = key_sketch.decode(codes.to(device), kmin.to(device), kmax.to(device), self.sketch_bits, dtype)
        return Sketched(keys.reshape(hkv, n * self.page_tokens, self.head_dim), pos.to(device), alive.to(device),
                        nbytes)

    def sketched_values(self, device: torch.device, pages: torch.Tensor) -> tuple[torch.Tensor, int] | None:
        """The given pages' (Hkv, n) estimated values (Hkv, n * P, d) float32, from their value sketches
        and value bounds, and the bytes read (codes and bounds); None where values are not sketched."""
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
        """New pages, each after the pages its head holds already, in order: the head of each (m,)
        (ascending), their ids, positions and alive flags (m, P), bounds (m, d), sketch codes (m, P, c),
        and the value sketch: codes (m, P, c) and bounds (m, d) twice (c and d = 0 without a sketch).
        Every table is written in one indexed copy for all heads."""
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
        """Make cold the tokens where mask (Hkv, L) is set; returns the page bytes written
        (``stage_demotion`` then ``commit``)."""
        staged = self.stage_demotion(keys, values, positions, mask)
        self.commit(staged)
        return staged.written

    def stage_demotion(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                       mask: torch.Tensor) -> Demotion:
        """Write the new pages of a demotion of the tokens where mask (Hkv, L) is set, and return it for
        ``commit``: the page table is left as it was, so a write that fails (``HostFull``, a Redis that
        cannot take a spill) leaves this layer unchanged, and a caller may stage every fallible step of
        a move before it changes anything.

        keys/values (Hkv, L, d), positions (Hkv, L). Tokens that already have a page slot (promoted
        earlier) become cold again in place; the others are written to new pages, in position order or,
        with ``by_keys``, grouped by their keys (``tiers.page_grouping``). Every head at once: a short
        turn demotes a few pages a head, and per-head steps cost more than the bytes."""
        p, hkv = self.page_tokens, mask.shape[0]
        mask, pos_cpu = mask.cpu(), positions.cpu()
        slots = self._slots_at(pos_cpu)
        staged = Demotion(torch.where(mask, pos_cpu, -1), torch.where(mask, slots, -1))
        fresh = mask & (slots < 0)
        counts = fresh.sum(dim=1)
        if not bool(counts.any()):
            return staged
        # The fresh tokens, head by head, in the order their pages take them: (head, store index) each.
        if self.by_keys and bool((counts > p).any()):
            order = self._grouped(keys, [torch.nonzero(fresh[i]).flatten() for i in range(hkv)])
            token_head = torch.repeat_interleave(torch.arange(hkv), counts)
            token_at = torch.cat(order)
        else:
            token_head, token_at = torch.nonzero(fresh).unbind(1)
        pages = (counts + p - 1) // p
        page_head = torch.repeat_interleave(torch.arange(hkv), pages)
        first_page = torch.cumsum(pages, 0) - pages
        first_token = torch.cumsum(counts, 0) - counts
        # Each page slot's token; a head's last page is padded with its last token's key (which keeps the
        # page's bounds), a zero value and position -1.
        m = int(pages.sum())
        dest = first_page[token_head] * p + torch.arange(token_at.numel()) - first_token[token_head]
        taken = torch.full((m * p,), -1, dtype=torch.long)
        taken[dest] = torch.arange(token_at.numel())
        pad = taken < 0
        filled = torch.where(pad, -1, torch.arange(m * p)).cummax(0).values  # a head's pages start with a token
        src = taken[filled]
        head_of, at = token_head[src], token_at[src]
        pos = torch.where(pad, -1, pos_cpu[head_of, at]).view(m, p)
        head_of, at = head_of.to(keys.device), at.to(keys.device)
        k = keys[head_of, at].view(m, p, -1)
        v = values[head_of, at].masked_fill(pad.to(keys.device).unsqueeze(-1), 0).view(m, p, -1)
        # Ids are never used twice, not even those of a write that failed: a spill of its first part
        # may still be under way in the host tier.
        ids = [self._page_id(self.epoch, self._made + j) for j in range(m)]
        self._made += m
        encoded = self.codec.encode(k, v)
        # Bounds of the keys a fetch gives back (with int8 these differ from k by up to half a step).
        stored, stored_v = self.codec.decode(encoded, self.dtype)
        kmin, kmax = outward(stored.amin(dim=1).cpu(), up=False), outward(stored.amax(dim=1).cpu(), up=True)
        codes = self._encode_sketch(stored, kmin, kmax)
        vsketch = self._sketch_values(stored_v, pos)
        try:
            staged.written = self.host.put_many(self.session_id, ids, encoded)
        except BaseException:
            # ``put_many`` takes back what it stored when it finds no room; on any other failure this does.
            self.host.free_many(self.session_id, ids)
            raise
        staged.ids, staged.pages = ids, (page_head, pos, kmin, kmax, codes, vsketch)
        return staged

    def commit(self, staged: Demotion) -> None:
        """Enter a staged demotion in the page table: its tokens are cold from now on. Table updates
        only, nothing that waits on a tier; should one fail all the same, the new pages are freed
        (the table may then be half-updated: the caller must not use the layer again)."""
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

    def _sketch_values(self, values: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The value sketch of pages: codes (m, P, c) within each page's value bounds (m, d), taken over
        its tokens (padding excluded) and rounded outward; widths 0 without a sketch. values (m, P, d) as
        a fetch gives them back, pos (m, P) (-1: padding)."""
        m, p, d = values.shape
        if not self.sketch_bits:
            return (torch.zeros(m, p, 0, dtype=torch.uint8), torch.zeros(m, 0, dtype=DIGEST_DTYPE),
                    torch.zeros(m, 0, dtype=DIGEST_DTYPE))
        v = values.cpu().float()
        real = (pos >= 0).unsqueeze(-1)
        vmin = outward(torch.where(real, v, float("inf")).amin(dim=1), up=False)
        vmax = outward(torch.where(real, v, float("-inf")).amax(dim=1), up=True)
        return key_sketch.encode(v, vmin, vmax, self.sketch_bits), vmin, vmax

    def _encode_sketch(self, keys: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
        """Sketch codes (m, P, c) of pages' keys (m, P, d) within their stored bounds; c = 0 without one."""
        if not self.sketch_bits:
            return torch.zeros(*keys.shape[:2], 0, dtype=torch.uint8)
        return key_sketch.encode(keys.cpu(), kmin, kmax, self.sketch_bits)

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
        positions, tiers = [], []
        first = 0
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
        p, d, hkv = self.page_tokens, self.head_dim, len(self.ids)
        n = pages.shape[1]
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
    def _restored_codes(self, tensors: dict[str, torch.Tensor], head: int, pages: int) -> torch.Tensor:
        """A head's sketch codes from a persisted page table. A table written without them (another
        ``sketch_bits``) gets the step just above the middle of every range: its tokens rank as their
        pages' centres do."""
        width = self._codes.buf.shape[-1]
        codes = tensors.get(f"codes{head}")
        if codes is not None and tuple(codes.shape) == (pages, self.page_tokens, width):
            return codes
        middle = sum(((1 << self.sketch_bits) // 2) << s for s in range(0, 8, self.sketch_bits or 8)) if width else 0
        return torch.full((pages, self.page_tokens, width), middle, dtype=torch.uint8)

    def _restored_values(self, tensors: dict[str, torch.Tensor], head: int, pages: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A head's value sketch from a persisted page table; for a table written without one, zeros,
        and no value sketch for this layer from then on (``values_sketched``)."""
        width, d = self._vcodes.buf.shape[-1], self._vmin.buf.shape[-1]
        got = tuple(tensors.get(f"{name}{head}") for name in ("vcodes", "vmin", "vmax"))
        shapes = ((pages, self.page_tokens, width), (pages, d), (pages, d))
        if all(t is not None and tuple(t.shape) == shape for t, shape in zip(got, shapes)):
            return got
        if width:
            self.values_sketched = False
        return (torch.zeros(*shapes[0], dtype=torch.uint8), torch.zeros(*shapes[1], dtype=DIGEST_DTYPE),
                torch.zeros(*shapes[2], dtype=DIGEST_DTYPE))

    def page_ids(self) -> list[str]:
        return [pid for ids in self.ids for pid in ids]

    def index_tensors(self) -> dict[str, torch.Tensor]:
        """The page table as tensors (written to Redis with the session's record)."""
        out = {}
        for i, ids in enumerate(self.ids):
            n = len(ids)
            out[f"pos{i}"] = self._pos.buf[i, :n].to(torch.int32)
            out[f"alive{i}"] = self._alive.buf[i, :n].clone()
            out[f"kmin{i}"] = self._kmin.buf[i, :n].clone()
            out[f"kmax{i}"] = self._kmax.buf[i, :n].clone()
            out[f"ids{i}"] = torch.tensor([packed_id(pid) for pid in ids], dtype=torch.int64)
            if self.sketch_bits:
                out[f"codes{i}"] = self._codes.buf[i, :n].clone()
                if self.values_sketched:
                    out[f"vcodes{i}"] = self._vcodes.buf[i, :n].clone()
                    out[f"vmin{i}"] = self._vmin.buf[i, :n].clone()
                    out[f"vmax{i}"] = self._vmax.buf[i, :n].clone()
        return out

    def snapshot(self) -> dict:
        """What the page table's tensors need besides themselves (JSON-able): its pages per head, which
        a restore checks the tensors against."""
        return {"pages": [len(ids) for ids in self.ids]}

    def restore(self, state: dict, tensors: dict[str, torch.Tensor]) -> list[str]:
        """Rebuild the page table from ``index_tensors`` and ``snapshot``; returns the page ids it names
        (the caller checks Redis holds them). Raises ``ValueError`` where the tensors do not match the
        snapshot or each other, leaving the table empty. New pages go under a fresh epoch."""
        self._reset(len(self.ids))
        try:
            self._restore(state, tensors)
        except (KeyError, IndexError, RuntimeError, TypeError, ValueError) as exc:
            self._reset(len(self.ids))
            raise ValueError(f"layer {self.layer}: page table does not match its record ({exc})") from None
        self._new_epoch()
        return self.page_ids()

    def _restore(self, state: dict, tensors: dict[str, torch.Tensor]) -> None:
        pages, p = state["pages"], self.page_tokens
        if len(pages) != len(self.ids):
            raise ValueError(f"{len(pages)} heads recorded, {len(self.ids)} in the cache")
        for i, n in enumerate(pages):
            packed = tensors[f"ids{i}"].tolist()
            pos, alive = tensors[f"pos{i}"].long(), tensors[f"alive{i}"].bool()
            if len(packed) != n or tuple(pos.shape) != (n, p) or tuple(alive.shape) != (n, p):
                raise ValueError(f"head {i}: {n} pages recorded, tables of {len(packed)} and {tuple(pos.shape)}")
            if bool((alive & (pos < 0)).any()):
                raise ValueError(f"head {i}: a cold token without a position")
            ids = [unpacked_id(self.layer, e) for e in packed]
            if ids:
                self._append(torch.full((len(ids),), i), ids, pos, alive,
                             outward(tensors[f"kmin{i}"], up=False), outward(tensors[f"kmax{i}"], up=True),
                             self._restored_codes(tensors, i, len(ids)), self._restored_values(tensors, i, len(ids)))

    def held_per_head(self) -> list[torch.Tensor]:
        """Each head's cold positions (unsorted), for checking a restore against its history."""
        return [self._pos.buf[h, : len(ids)][self._alive.buf[h, : len(ids)]] for h, ids in enumerate(self.ids)]


def page_id(layer: int, epoch: int, n: int) -> str:
    return f"l{layer}-{epoch:08x}-{n}"


def unpacked_id(layer: int, packed: int) -> str:
    """The id of a page of ``layer`` from its ``packed_id``."""
    return page_id(layer, packed >> 32, packed & 0xFFFFFFFF)


def page_names(layer: int, index: dict[str, torch.Tensor]) -> list[str]:
    """The ids of the pages a layer's page table (``index_tensors``) names, every head's."""
    return [unpacked_id(layer, e) for name, ids in index.items() if name.startswith("ids") for e in ids.tolist()]


def packed_id(pid: str) -> int:
    """A page id's epoch and counter in one int64 (how page tables store ids)."""
    _, epoch, n = pid.split("-")
    return (int(epoch, 16) << 32) | int(n)
