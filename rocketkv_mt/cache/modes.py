"""The cache modes a session may ask for, each a prefill policy composed with a decode policy."""
from __future__ import annotations

from types import MappingProxyType

from rocketkv_mt.cache.decode.dense import DenseDecode
from rocketkv_mt.cache.decode.hsa import HSADecode
from rocketkv_mt.cache.mode import CacheMode
from rocketkv_mt.cache.prefill.evict_once import EvictOnce
from rocketkv_mt.cache.prefill.keep import KeepAll
from rocketkv_mt.cache.prefill.reselect_device import ReselectDevice
from rocketkv_mt.cache.prefill.tiered import ReselectTiered

CACHE_MODES = MappingProxyType({mode.name: mode for mode in (
    CacheMode("full", KeepAll, DenseDecode),  # the whole conversation, dense
    CacheMode("snapkv", EvictOnce, DenseDecode),  # Stage 1 at every prefill; evicted tokens are gone
    CacheMode("rocketkv", EvictOnce, HSADecode),  # the paper: Stage 1 at prefill, HSA at decode
    CacheMode("rocketkv-mt", ReselectDevice, HSADecode),  # the paper's multi-turn variant
    CacheMode("tiered", ReselectTiered, HSADecode),  # rocketkv-mt with the unselected history in cold tiers
)})


def cache_mode(name: str) -> CacheMode:
    """The registered mode called ``name``; ValueError naming the modes when there is none."""
    try:
        return CACHE_MODES[name]
    except KeyError:
        raise ValueError(f"unknown cache mode {name!r}; one of {sorted(CACHE_MODES)}") from None
