"""Session caches behind ``SessionCache``: one class (``ComposedCache``) whose mode is a prefill policy
(``prefill/``) composed with a decode policy (``decode/``), registered by name in ``CACHE_MODES``."""
from __future__ import annotations

from rocketkv_mt.cache.base import CacheBroken, CacheSpec, SessionCache
from rocketkv_mt.cache.composed import ComposedCache
from rocketkv_mt.cache.mode import CacheMode
from rocketkv_mt.cache.modes import CACHE_MODES, cache_mode
from rocketkv_mt.cache.policy import TurnSize
from rocketkv_mt.cache.tier_context import TierContext, TierPolicy
from rocketkv_mt.config import RocketKVConfig


def make_cache(
    mode: str, spec: CacheSpec, rocket: RocketKVConfig | None = None, tiers: TierContext | None = None
) -> SessionCache:
    """A new, empty cache of the given mode (``tiers``: where its cold tokens go, for modes that keep any)."""
    return ComposedCache(cache_mode(mode), spec, rocket, tiers)


__all__ = [
    "CACHE_MODES", "CacheBroken", "CacheMode", "CacheSpec", "SessionCache", "TierContext", "TierPolicy", "TurnSize", "cache_mode",
    "make_cache",
]
