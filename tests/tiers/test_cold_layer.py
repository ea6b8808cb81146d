"""The cold pages of one layer (``tiers.cold.layer.ColdLayer``) on a host tier without Redis, and the
page codecs: pure bookkeeping and tensors, no model."""
import json

import pytest
import torch

from tiers.base import Traffic
from tiers.codec import Int8Codec, RawCodec
from tiers.cold.layer import DIGEST_DTYPE, ColdLayer
from tiers.cold.table import Table
from tiers.host.tier import HostFull, HostTier
from tiers.store.wire import pack, unpack

HKV, D, P, STORE = 3, 8, 16, 90
DTYPE = torch.bfloat16
PAGE_BYTES = 2 * P * D * 2  # keys and values, bf16


def make_store(seed: int):
    """A device store: keys, values (Hkv, T, d) and ascending positions (Hkv, T), a subset per head."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(HKV, STORE, D, generator=gen).to(DTYPE)
    values = torch.randn(HKV, STORE, D, generator=gen).to(DTYPE)
    positions = torch.stack([torch.randperm(200, generator=gen)[:STORE].sort().values for _ in range(HKV)])
    return keys, values, positions


def make_mask(counts: list[int], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros(HKV, STORE, dtype=torch.bool)
    for h, n in enumerate(counts):
        mask[h, torch.randperm(STORE, generator=gen)[:n]] = True
    return mask


def new_layer(host: HostTier, session: str = "s1", codec=None) -> ColdLayer:
    return ColdLayer(session, 2, host, P, codec or RawCodec(), HKV, D, DTYPE)


def fetch_all(layer: ColdLayer):
    traffic = Traffic()
    pages = layer.live_pages()
    return pages, layer.fetch(pages, torch.device("cpu"), traffic), traffic


def by_position(keys, values, positions, h: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    return {int(p): (keys[h, i], values[h, i]) for i, p in enumerate(positions[h].tolist()) if p >= 0}


def test_demote_fetch_promote_and_demote_again():
    keys, values, positions = make_store(0)
    host = HostTier(1 << 20, pin=False)
    layer = new_layer(host)
    mask = make_mask([37, 20, 5], seed=1)  # different tokens and counts per head; partial last pages
    written = layer.demote(keys, values, positions, mask)
    pages_per_head = [3, 2, 1]
    assert written == sum(pages_per_head) * PAGE_BYTES == host.stats.bytes_written == host.session_bytes("s1")
    for h in range(HKV):
        assert torch.equal(layer.held_positions(h), positions[h][mask[h]].sort().values)
    assert layer.alive_count() == 37

    # Fetch every live page: bit-exact keys and values, and each slot's position, alive flag and flat slot.
    pages, (k, v, pos, alive, slots), traffic = fetch_all(layer)
    assert (pages >= 0).sum(dim=1).tolist() == pages_per_head
    assert k.shape == v.shape == (HKV, 3 * P, D) and k.dtype == DTYPE
    assert pos.shape == alive.shape == slots.shape == (HKV, 3 * P)
    assert traffic.cold_bytes_read == sum(pages_per_head) * PAGE_BYTES and traffic.redis_bytes_read == 0
    for h in range(HKV):
        want = by_position(keys, values, positions, h)
        n = pages_per_head[h] * P
        assert sorted(pos[h][alive[h]].tolist()) == layer.held_positions(h).tolist()
        for j in torch.nonzero(alive[h]).flatten().tolist():
            wk, wv = want[int(pos[h, j])]
            assert torch.equal(k[h, j], wk) and torch.equal(v[h, j], wv)
        assert torch.equal(slots[h, :n], torch.arange(n))  # all pages of the head, in order
        assert (pos[h, n:] == -1).all() and not alive[h, n:].any() and (slots[h, n:] == -1).all()
        assert torch.equal(pos[h, :n][alive[h, :n]], positions[h][mask[h]])  # pages in position order
        assert int(alive[h].sum()) == int(mask[h].sum())

    # Digests: per page and channel, the min and max of the page's keys.
    kmin, kmax, live, nbytes = layer.digests(torch.device("cpu"))
    assert kmin.shape == kmax.shape == (HKV, 3, D) and live.shape == (HKV, 3)
    assert nbytes == 2 * sum(pages_per_head) * D * 2
    for h in range(HKV):
        m = pages_per_head[h]
        page_keys = k[h, : m * P].view(m, P, D).float()
        page_alive = alive[h, : m * P].view(m, P, 1)
        assert torch.equal(kmin[h, :m].float(), page_keys.masked_fill(~page_alive, float("inf")).amin(dim=1))
        assert torch.equal(kmax[h, :m].float(), page_keys.masked_fill(~page_alive, float("-inf")).amax(dim=1))
        assert live[h, :m].all() and not live[h, m:].any()

    # Promote a few tokens per head (as a turn's re-selection does), then demote them again.
    promoted = torch.stack([torch.where(alive[h], slots[h], -1) for h in range(HKV)])
    promoted[:, 1::3] = -1  # keep two in three of them, in every page
    back = [set(pos[h][promoted[h] >= 0].tolist()) for h in range(HKV)]
    layer.promote(promoted)
    for h in range(HKV):
        held = positions[h][mask[h]].tolist()
        assert layer.held_positions(h).tolist() == sorted(set(held) - back[h])
    before = host.stats.bytes_written
    again = torch.stack([torch.isin(positions[h], torch.tensor(sorted(back[h]), dtype=torch.long)) for h in range(HKV)])
    assert layer.demote(keys, values, positions, again) == 0  # the pages kept their copies
    assert host.stats.bytes_written == before and host.session_bytes("s1") == written
    for h in range(HKV):
        assert torch.equal(layer.held_positions(h), positions[h][mask[h]].sort().values)
    assert torch.equal(layer.digests(torch.device("cpu"))[0], kmin)

    # A mixture of tokens cold before and new ones: only the new ones are written.
    more = mask | make_mask([10, 10, 10], seed=2)
    fresh = [int((more[h] & ~mask[h]).sum()) for h in range(HKV)]
    new_pages = sum(-(-n // P) for n in fresh)
    assert layer.demote(keys, values, positions, more) == new_pages * PAGE_BYTES
    for h in range(HKV):
        assert torch.equal(layer.held_positions(h), positions[h][more[h]].sort().values)
    assert len(set(layer.page_ids())) == len(layer.page_ids()) == sum(pages_per_head) + new_pages


def residency_of(layer: ColdLayer) -> list[list[torch.Tensor]]:
    r = layer.residency()
    return [r.positions, r.tiers, r.promoted, r.demoted]


def some_promoted(seed: int, host: HostTier):
    """A layer of pages of which some tokens were promoted, and a demotion to try on it: those tokens
    again (cold again in place) and new ones (new pages). Returns (layer, store, the demotion's mask)."""
    keys, values, positions = make_store(seed)
    layer = new_layer(host)
    mask = make_mask([40, 25, 9], seed=seed + 1)  # 3, 2 and 1 pages
    layer.demote(keys, values, positions, mask)
    _, (_, _, pos, alive, slots), _ = fetch_all(layer)
    layer.promote(torch.where(alive & (pos % 2 == 0), slots, -1))
    return layer, (keys, values, positions), mask | make_mask([10, 10, 10], seed=seed + 2)


def test_a_demotion_the_host_tier_has_no_room_for_leaves_the_layer_as_it_was():
    # A host tier of exactly the first demotion's 6 pages, and no Redis to spill to.
    host = HostTier(6 * PAGE_BYTES, pin=False, page_bytes=PAGE_BYTES)
    layer, store, more = some_promoted(30, host)
    held = [layer.held_positions(h) for h in range(HKV)]
    ids, moved, stored = layer.page_ids(), residency_of(layer), host.session_bytes("s1")
    with pytest.raises(HostFull):
        layer.demote(*store, more)
    # Not one token made cold: the promoted ones are still on the device, the new ones have no page.
    assert all(torch.equal(layer.held_positions(h), held[h]) for h in range(HKV))
    assert layer.page_ids() == ids and host.session_bytes("s1") == stored
    assert all(torch.equal(a, b) for was, now in zip(moved, residency_of(layer)) for a, b in zip(was, now))
    # Staged in two steps, the same demotion writes first and changes the table only when committed.
    roomy = HostTier(1 << 20, pin=False)
    layer, store, more = some_promoted(30, roomy)
    held = [layer.held_positions(h) for h in range(HKV)]
    staged = layer.stage_demotion(*store, more)
    assert staged.written > 0 and roomy.session_bytes("s1") == 6 * PAGE_BYTES + staged.written
    assert all(torch.equal(layer.held_positions(h), held[h]) for h in range(HKV))
    layer.commit(staged)
    for h in range(HKV):
        assert torch.equal(layer.held_positions(h), store[2][h][more[h]].sort().values)


def test_a_page_table_that_fails_to_take_a_demotion_frees_its_new_pages(monkeypatch):
    host = HostTier(1 << 20, pin=False)
    layer, store, more = some_promoted(40, host)
    stored = host.session_bytes("s1")

    def failing(*args, **kwargs):
        raise RuntimeError("injected: the page table could not grow")

    monkeypatch.setattr(ColdLayer, "_append", failing)
    with pytest.raises(RuntimeError, match="injected"):
        layer.demote(*store, more)
    # The table may be half-updated (its caller must drop the layer), but no page is left unowned.
    assert host.session_bytes("s1") == stored
    layer.free()
    assert host.session_bytes("s1") == 0 and host.stats.entries == 0


def test_free_empties_the_host_tier_for_the_session_only():
    keys, values, positions = make_store(3)
    host = HostTier(1 << 20, pin=False)
    a, b = new_layer(host, "a"), new_layer(host, "b")
    a.demote(keys, values, positions, make_mask([30, 30, 30], seed=4))
    b.demote(keys, values, positions, make_mask([20, 20, 20], seed=5))
    b_bytes = host.session_bytes("b")
    _, before, _ = fetch_all(b)
    a.free()
    assert host.session_bytes("a") == 0 and not a.has_pages()
    assert a.live_pages().numel() == 0
    assert host.stats.bytes == host.session_bytes("b") == b_bytes and host.stats.entries == b_bytes // PAGE_BYTES
    _, after, _ = fetch_all(b)
    assert all(torch.equal(x, y) for x, y in zip(before, after))
    b.free()
    assert host.stats.bytes == 0 and host.stats.entries == 0


def test_restore_from_the_index_gives_the_same_cold_tokens():
    keys, values, positions = make_store(6)
    host = HostTier(1 << 20, pin=False)
    layer = new_layer(host)
    layer.demote(keys, values, positions, make_mask([40, 40, 40], seed=7))
    _, (_, _, pos, alive, slots), _ = fetch_all(layer)
    layer.promote(torch.where(alive & (pos % 2 == 0), slots, -1))  # some tokens are on the device now
    # The page table as persistence stores it: tensors through the store's wire format, state through JSON.
    tensors = unpack(pack(layer.index_tensors()))
    state = json.loads(json.dumps(layer.snapshot()))

    copy = new_layer(host)
    copy.restore(state, tensors)
    assert copy.page_ids() == layer.page_ids()
    for h in range(HKV):
        assert torch.equal(copy.held_positions(h), layer.held_positions(h))
    _, want, _ = fetch_all(layer)
    pages, got, _ = fetch_all(copy)
    assert all(torch.equal(x, y) for x, y in zip(want, got))
    *digests, nbytes = layer.digests(torch.device("cpu"))
    *copied, copied_nbytes = copy.digests(torch.device("cpu"))
    assert all(torch.equal(x, y) for x, y in zip(digests, copied)) and nbytes == copied_nbytes
    # Promoted tokens demoted again in the restored layer write nothing; new pages get new ids.
    assert copy.demote(keys, values, positions, make_mask([40, 40, 40], seed=7)) == 0
    copy.demote(keys, values, positions, make_mask([60, 60, 60], seed=8))
    assert len(set(copy.page_ids())) == len(copy.page_ids()) > len(layer.page_ids())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_codec_error_is_within_one_step_of_each_scale_group(dtype):
    gen = torch.Generator().manual_seed(9)
    n, p, d = 5, 32, 64
    keys = torch.randn(n, p, d, generator=gen) * torch.linspace(0.1, 20, d)  # outlier channels
    values = torch.randn(n, p, d, generator=gen) * torch.linspace(0.1, 5, p).view(p, 1)
    keys[0, :, 3] = 0  # an all-zero group
    keys, values = keys.to(dtype), values.to(dtype)
    codec = Int8Codec()
    batch = codec.encode(keys, values)
    assert batch["keys"].dtype == batch["values"].dtype == torch.int8
    k, v = codec.decode(batch, dtype)
    assert k.dtype == v.dtype == dtype and k.shape == keys.shape and v.shape == values.shape
    kmax = keys.float().abs().amax(dim=1, keepdim=True)  # per page and channel
    vmax = values.float().abs().amax(dim=2, keepdim=True)  # per token
    assert ((k.float() - keys.float()).abs() <= kmax / 127).all()
    assert ((v.float() - values.float()).abs() <= vmax / 127).all()
    assert (k[0, :, 3] == 0).all()


def test_int8_pages_are_much_smaller_than_bf16():
    n, p, d = 4, 32, 64
    keys, values = torch.randn(n, p, d).to(torch.bfloat16), torch.randn(n, p, d).to(torch.bfloat16)
    raw = sum(t.numel() * t.element_size() for t in RawCodec().encode(keys, values).values())
    int8 = sum(t.numel() * t.element_size() for t in Int8Codec().encode(keys, values).values())
    assert raw == n * 2 * p * d * 2
    assert int8 < 0.6 * raw
    host = HostTier(1 << 20, pin=False)  # what the host tier charges per page agrees
    host.put_many("s", [f"p{i}" for i in range(n)], Int8Codec().encode(keys, values))
    assert host.page_bytes * n == int8 == host.stats.bytes


def test_digests_bound_the_keys_the_tier_gives_back_with_int8():
    """Stage 1 scores the keys a fetch returns (dequantized): the page bounds must hold for those."""
    keys, values, positions = make_store(10)
    layer = new_layer(HostTier(1 << 20, pin=False), codec=Int8Codec())
    layer.demote(keys, values, positions, make_mask([50, 50, 50], seed=11))
    pages, (k, _, _, alive, _), _ = fetch_all(layer)
    kmin, kmax, _, _ = layer.digests(torch.device("cpu"))
    for h in range(HKV):
        m = int((pages[h] >= 0).sum())
        page_keys, page_alive = k[h, : m * P].view(m, P, D), alive[h, : m * P].view(m, P, 1)
        assert ((page_keys >= kmin[h, :m, None]) | ~page_alive).all()
        assert ((page_keys <= kmax[h, :m, None]) | ~page_alive).all()


def test_digests_of_float32_keys_are_bfloat16_bounds_one_step_wide_at_most():
    from tiers.cold.table import outward

    x = torch.randn(1000) * 3
    lo, hi = outward(x, up=False), outward(x, up=True)
    assert lo.dtype == hi.dtype == DIGEST_DTYPE
    assert (lo.float() <= x).all() and (hi.float() >= x).all()
    assert not (lo.float() == x).all()  # random float32 values are mostly not bfloat16 values
    step = (x.abs() * 2.0**-7).clamp_min(2.0**-126)  # bfloat16 keeps 8 significant bits
    assert ((x - lo.float()) <= step).all() and ((hi.float() - x) <= step).all()
    exact = x.to(DIGEST_DTYPE)
    assert torch.equal(outward(exact.float(), up=True), exact) and torch.equal(outward(exact.float(), up=False), exact)


@pytest.mark.parametrize("bits", [2, 4])
def test_a_sketch_estimates_every_cold_key_and_survives_a_restore(bits):
    keys, values, positions = make_store(12)
    host = HostTier(1 << 20, pin=False)
    layer = ColdLayer("s1", 2, host, P, RawCodec(), HKV, D, DTYPE, sketch_bits=bits)
    layer.demote(keys, values, positions, make_mask([40, 25, 9], seed=13))
    every = torch.stack([torch.arange(3), torch.tensor([0, 1, -1]), torch.tensor([0, -1, -1])])
    assert torch.equal(layer.live_pages(), every)
    sk = layer.sketched(torch.device("cpu"), every)
    est, pos, alive, nbytes = sk.keys, sk.positions, sk.alive, sk.nbytes
    kmin, kmax, _, _ = layer.digests(torch.device("cpu"))
    pages = [len(ids) for ids in layer.ids]
    per_page = P * D * bits // 8 + 2 * D * DIGEST_DTYPE.itemsize  # the codes and the bounds they step within
    assert nbytes == sum(pages) * per_page
    assert est.shape == (HKV, max(pages) * P, D) and est.dtype == torch.float32
    for h in range(HKV):
        truth = by_position(keys, values, positions, h)
        step = ((kmax[h].float() - kmin[h].float()) / (1 << bits)).repeat_interleave(P, dim=0)
        for i in torch.nonzero(alive[h]).flatten().tolist():
            err = (est[h, i] - truth[int(pos[h, i])][0].float()).abs()
            assert (err <= step[i] / 2 + 1e-6).all()
        assert int(alive[h].sum()) == [40, 25, 9][h]
    # Some pages only: the same rows for those, dead slots for the padding.
    some = torch.tensor([[1, 2], [1, -1], [-1, -1]])
    sk = layer.sketched(torch.device("cpu"), some)
    part, part_pos, part_alive, part_nbytes = sk.keys, sk.positions, sk.alive, sk.nbytes
    assert part_nbytes == 3 * per_page and part.shape == (HKV, 2 * P, D)
    # After every page's bounds were read (``digests``), a pool's read is its codes alone.
    assert layer.sketched(torch.device("cpu"), some, bounds_read=True).nbytes == 3 * P * D * bits // 8
    assert torch.equal(part[0], est[0, P:]) and torch.equal(part[1, :P], est[1, P : 2 * P])
    assert torch.equal(part_pos[0], pos[0, P:]) and torch.equal(part_alive[0], alive[0, P:])
    assert not part_alive[1, P:].any() and not part_alive[2].any() and (part_pos[2] == -1).all()
    # Persisted and restored, the sketch is the same; a table persisted without one gets middle steps.
    tensors = unpack(pack(layer.index_tensors()))
    copy = ColdLayer("s1", 2, host, P, RawCodec(), HKV, D, DTYPE, sketch_bits=bits)
    copy.restore(json.loads(json.dumps(layer.snapshot())), tensors)
    got = copy.sketched(torch.device("cpu"), every)
    assert all(torch.equal(x, y) for x, y in zip((got.keys, got.positions, got.alive), (est, pos, alive)))
    assert got.nbytes == nbytes
    plain = new_layer(host)
    plain.restore(layer.snapshot(), {k: t for k, t in tensors.items() if not k.startswith("codes")})
    blind = ColdLayer("s1", 2, host, P, RawCodec(), HKV, D, DTYPE, sketch_bits=bits)
    blind.restore(layer.snapshot(), plain.index_tensors())
    middle = blind.sketched(torch.device("cpu"), every).keys
    valid = (every >= 0).repeat_interleave(P, dim=1)
    lo, hi = kmin.float().repeat_interleave(P, dim=1), kmax.float().repeat_interleave(P, dim=1)
    middle, lo, hi = middle[valid], lo[valid], hi[valid]
    assert ((middle >= lo - 1e-6) & (middle <= hi + 1e-6)).all()
    assert torch.allclose(middle, lo + (hi - lo) * ((1 << bits) // 2 + 0.5) / (1 << bits))


def test_a_cold_layer_refuses_a_sketch_it_cannot_pack():
    with pytest.raises(ValueError):
        ColdLayer("s1", 2, HostTier(1 << 20, pin=False), P, RawCodec(), HKV, 6, DTYPE, sketch_bits=2)


def test_a_sketched_page_keeps_a_value_sketch_and_a_restore_keeps_it():
    """Each token's value is known to half a step of its page's value range (padding excluded from the
    range), read back by page (codes and bounds, counted), persisted with the page table; a table
    written without value sketches restores with none for that layer, not with zeros."""
    keys, values, positions = make_store(12)
    host = HostTier(1 << 20, pin=False)
    layer = ColdLayer("s1", 2, host, P, RawCodec(), HKV, D, DTYPE, sketch_bits=4)
    layer.demote(keys, values, positions, make_mask([40, 25, 9], seed=13))
    every = layer.live_pages()
    est, nbytes = layer.sketched_values(torch.device("cpu"), every)
    pages = [len(ids) for ids in layer.ids]
    assert nbytes == sum(pages) * (P * D // 2 + 2 * D * DIGEST_DTYPE.itemsize)
    assert est.shape == (HKV, every.shape[1] * P, D) and est.dtype == torch.float32
    sk = layer.sketched(torch.device("cpu"), every)
    for h in range(HKV):
        truth = by_position(keys, values, positions, h)
        for j in range(pages[h]):
            at = sk.positions[h, j * P : (j + 1) * P]
            real = [int(x) for x in at if x >= 0]
            vals = torch.stack([truth[x][1].float() for x in real])
            step = (vals.amax(dim=0) - vals.amin(dim=0)) / 16
            for i, x in enumerate(at.tolist()):
                if x >= 0:
                    err = (est[h, j * P + i] - truth[x][1].float()).abs()
                    assert (err <= step / 2 * 1.02 + 1e-6).all()  # bfloat16 bounds rounded outward: a hair wider
    tensors = unpack(pack(layer.index_tensors()))
    copy = ColdLayer("s1", 2, host, P, RawCodec(), HKV, D, DTYPE, sketch_bits=4)
    copy.restore(layer.snapshot(), tensors)
    assert torch.equal(copy.sketched_values(torch.device("cpu"), every)[0], est)
    older = ColdLayer("s1", 2, host, P, RawCodec(), HKV, D, DTYPE, sketch_bits=4)
    older.restore(layer.snapshot(), {k: t for k, t in tensors.items() if not k.startswith("v")})
    assert not older.values_sketched and older.sketched_values(torch.device("cpu"), every) is None
    assert not any(k.startswith("v") for k in older.index_tensors())
    assert new_layer(host).sketched_values(torch.device("cpu"), every) is None  # no sketch at all


def test_table_take_gives_each_head_its_own_rows():
    table = Table(HKV, (P, 4), torch.uint8)
    table.ensure(40)
    table.buf.copy_(torch.randint(0, 256, table.buf.shape, dtype=torch.uint8))
    pages = torch.tensor([[0, 5, 5, 39], [7, 0, 1, 2], [39, 38, 0, 0]])
    taken = table.take(pages)
    assert taken.shape == (HKV, 4, P, 4)
    for h in range(HKV):
        for j, page in enumerate(pages[h].tolist()):
            assert torch.equal(taken[h, j], table.buf[h, page])


def test_live_page_count_is_the_width_of_live_pages_as_pages_empty():
    keys, values, positions = make_store(3)
    layer = new_layer(HostTier(1 << 20, pin=False))
    assert layer.live_page_count() == 0
    layer.demote(keys, values, positions, make_mask([40, 20, 5], seed=4))  # 3, 2 and 1 pages
    assert layer.live_page_count() == layer.live_pages().shape[1] == 3
    # Promote every cold token of head 0's first two pages: those pages hold none, yet still exist.
    _, (_, _, _, alive, slots), _ = fetch_all(layer)
    promoted = torch.full_like(slots, -1)
    promoted[0, : 2 * P] = torch.where(alive[0, : 2 * P], slots[0, : 2 * P], -1)
    layer.promote(promoted)
    assert layer.live_pages().shape[1] == layer.live_page_count() == 2  # head 1's two pages
    assert layer.live_page_count(at_most=3) == 3  # within 3 either way: told without counting
    assert layer.live_page_count(at_most=2) == 2
