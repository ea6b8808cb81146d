"""Session caches, one class per mode, behind ``SessionCache``."""
from __future__ import annotations

from rocketkv_mt.cache.base import CacheSpec, SessionCache
from rocketkv_mt.cache.full import FullCache
from rocketkv_mt.cache.rocketkv import RocketKVCache
from rocketkv_mt.cache.rocketkv_mt import RocketKVMTCache
from rocketkv_mt.cache.snapkv import SnapKVCache
from rocketkv_mt.cache.tiered import TierContext, TieredCache
from rocketkv_mt.config import RocketKVConfig

CACHE_MODES: dict[str, type[SessionCache]] = {
    cls.mode: cls for cls in (FullCache, SnapKVCache, RocketKVCache, RocketKVMTCache, TieredCache)
}


def make_cache(
    mode: str, spec: CacheSpec, rocket: RocketKVConfig | None = None, tiers: TierContext | None = None
) -> SessionCache:
    """A new, empty cache of the given mode (``tiers`` is where a tiered cache keeps cold tokens)."""
    try:
        cls = CACHE_MODES[mode]
    except KeyError:
        raise ValueError(f"unknown cache mode {mode!r}; one of {sorted(CACHE_MODES)}") from None
    if cls is TieredCache:
        return cls(spec, rocket, tiers=tiers)
    return cls(spec, rocket)


__all__ = ["CACHE_MODES", "CacheSpec", "SessionCache", "TierContext", "make_cache"]
