"""What a tiered turn may hold on the device and write to the cold tiers, before it runs: the
memory model's bounds (``TurnSize``) for the ``tiered`` mode.

Pure functions of a turn's sizes and the engine's tier policy; ``ReselectTiered`` (``policy``) exposes
them as its static ``bound``, ``decode_tokens`` and ``cold_tokens_written``, which the engine's memory
model and admission call through the cache mode (``rocketkv_mt.cache.mode``).
"""
from __future__ import annotations

import math

from rocketkv_mt.cache.policy import TurnSize
from rocketkv_mt.cache.prefill.tiered.reads import POOL_PAGES_STEP, reads_whole
from rocketkv_mt.cache.tier_context import TierPolicy
from rocketkv_mt.cold_select import pages_per_head


def bound(turn: TurnSize, tiers: TierPolicy) -> int:
    """The primary set as ``EvictOnce`` bounds it, plus what a turn reads back: every cold page of
    one layer (keys and values) at a time when every layer is read whole (``reads_whole``); else
    the pages of every layer, held until its first decode step settles the selection, plus one
    layer's digests and scratch."""
    kv = turn.token_bytes * turn.kept_after + turn.uncompressed_bytes
    if tiers.reselect == "exhaustive" and turn.cold_pages is None:
        return kv + turn.layer_bytes * 2 * (turn.fed + turn.new)
    if turn.cold_pages is not None and reads_whole(tiers, turn.cold_pages, turn.split.prompt_budget):
        # One layer's device keys and the pages it read, joined, and that layer's selection of them;
        # and the next layer's pages, read meanwhile (``ColdReads.prefetch``).
        return kv + turn.layer_bytes * 2 * (turn.kept + 2 * turn.cold_pages * tiers.page_tokens + turn.new)
    pages = pages_per_head(tiers.candidates, turn.split.prompt_budget, tiers.page_tokens)
    # A sketch's scratch: the pool's estimated keys (float32 at most), the logits of up to 2d window
    # rows at a time over them (``page_picks``; bfloat16 where the keys are) and the next layer's
    # pool being decoded (its codes widened to table indices, its keys in float32, then rounded):
    # with the torch path's float32 shares of a chunk, at most 24 * Hkv * d bytes a pool token and
    # its masks: 6 tokens' keys and values of one layer in a 16-bit model, 3 in a 32-bit one. The
    # stand-in (``rocketkv_mt.standin``) adds as many tokens as the pages read: their gathered keys and
    # decoded values in float32 (2 tokens' keys and values of one layer each in a 16-bit model), then
    # joined with the pages read into one part (a copy of both: 2 more).
    pool_pages = min(math.ceil(turn.fed / tiers.page_tokens), math.ceil(pages * tiers.sketch_pool))
    pool = (pool_pages + -pool_pages % POOL_PAGES_STEP) * tiers.page_tokens  # padded (``padded_pool``)
    sketch = turn.layer_bytes * 6 * pool if tiers.sketched else 0
    if tiers.sketched and tiers.standin:
        sketch += turn.layer_bytes * 4 * min(turn.fed, pages * tiers.page_tokens)
    return (kv + turn.token_bytes * min(turn.fed, pages * tiers.page_tokens) + sketch
            + turn.layer_bytes * 2 * (math.ceil(turn.fed / tiers.page_tokens) + turn.new))


def decode_tokens(turn: TurnSize) -> int:
    """The decode set's length at most: the primary set the turn keeps, and its decode tokens."""
    return turn.kept_after


def cold_tokens_written(turn: TurnSize) -> int:
    """A layer's one selection a turn keeps the prompt budget out of the device's tokens and the cold
    ones it promotes; the device's others are demoted, and a token that was cold before goes back to
    its page: at most the device's tokens past the budget, plus as many as it could promote."""
    device, budget = turn.kept + turn.new, turn.split.prompt_budget
    return 0 if device <= budget else device - budget + min(budget, max(0, turn.fed - turn.kept))
