"""Host tier: a bounded pool of fixed-size chunk slots in CPU memory; least recently used chunks spill to Redis.

Slots are pinned when CUDA is present so copies to the device can be asynchronous. Chunks returned
by ``get`` are views into slots: callers copy what they need before the next ``put``.
"""
from __future__ import annotations

import logging
from collections import OrderedDict

import torch

from tiers.base import Chunk, TierStats
from tiers.redis_tier import RedisTier

log = logging.getLogger(__name__)
ChunkKey = tuple[str, str]  # (session id, chunk id)


class ChunkUnavailable(KeyError):
    """A cold chunk is neither in host memory nor readable from Redis (not there, or Redis is down)."""


class HostTier:
    def __init__(self, capacity_bytes: int, redis: RedisTier | None = None, pin: bool | None = None):
        self.capacity_bytes = capacity_bytes
        self.redis = redis
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.stats = TierStats()
        self.overflow_slots = 0  # slots allocated past the bound because nothing could spill
        self._slots: list[Chunk] = []
        self._free: list[int] = []
        self._resident: OrderedDict[ChunkKey, int] = OrderedDict()
        self._in_redis: set[ChunkKey] = set()
        self._slot_bytes = 0

    # --- slots -------------------------------------------------------------------------------
    @property
    def max_slots(self) -> int:
        return max(1, self.capacity_bytes // self._slot_bytes) if self._slot_bytes else 0

    def _new_slot(self, like: Chunk) -> int:
        def empty(t: torch.Tensor) -> torch.Tensor:
            return torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin)

        self._slots.append(Chunk(empty(like.keys), empty(like.values), empty(like.positions)))
        return len(self._slots) - 1

    def _take_slot(self, like: Chunk) -> int:
        if not self._slot_bytes:
            self._slot_bytes = like.nbytes()
        if like.nbytes() != self._slot_bytes:
            raise ValueError("every chunk in the host tier has the same size")
        if self._free:
            return self._free.pop()
        if len(self._slots) < self.max_slots:
            return self._new_slot(like)
        if self._spill_lru():
            return self._free.pop()
        self.overflow_slots += 1
        return self._new_slot(like)

    def _spill_lru(self) -> bool:
        """Move the least recently used chunk to Redis; False when there is nowhere to spill."""
        if self.redis is None or not self._resident:
            return False
        key, slot = next(iter(self._resident.items()))
        if key not in self._in_redis:
            if not self.redis.put_chunk(*key, self._slots[slot]):
                return False
            self._in_redis.add(key)
        del self._resident[key]
        self._free.append(slot)
        self.stats.spills += 1
        self.stats.entries -= 1
        self.stats.bytes -= self._slot_bytes
        return True

    # --- chunks ------------------------------------------------------------------------------
    def put(self, key: ChunkKey, chunk: Chunk) -> None:
        """Store a chunk demoted from the device (copied into a slot)."""
        self._store(key, chunk)
        self.stats.demotions += 1

    @torch.inference_mode()
    def _store(self, key: ChunkKey, chunk: Chunk) -> int:
        # Inference mode: slots made during a model step are inference tensors, writable only there.
        slot = self._take_slot(chunk)
        dst = self._slots[slot]
        for name in ("keys", "values", "positions"):
            getattr(dst, name).copy_(getattr(chunk, name))
        self._resident[key] = slot
        self.stats.entries += 1
        self.stats.bytes += self._slot_bytes
        return slot

    def get(self, key: ChunkKey) -> Chunk:
        """A chunk, fetched back from Redis if it was spilled (a promotion into this tier)."""
        slot = self._resident.get(key)
        if slot is not None:
            self._resident.move_to_end(key)
            self.stats.hits += 1
            return self._slots[slot]
        self.stats.misses += 1
        chunk = self.redis.get_chunk(*key) if self.redis is not None and key in self._in_redis else None
        if chunk is None:
            raise ChunkUnavailable(f"chunk {key} is in no tier that can be read now")
        slot = self._store(key, chunk)
        self.stats.promotions += 1
        return self._slots[slot]

    def free(self, key: ChunkKey) -> None:
        slot = self._resident.pop(key, None)
        if slot is not None:
            self._free.append(slot)
            self.stats.entries -= 1
            self.stats.bytes -= self._slot_bytes
        if key in self._in_redis:
            self._in_redis.discard(key)
            if self.redis is not None:
                self.redis.delete_chunk(*key)

    def drop_session(self, session_id: str) -> int:
        """Give back the slots of a session leaving this process, keeping its Redis copies.

        Unlike ``free``, nothing is deleted from Redis: the session's stored state (which another
        replica, or this one later, restores) still refers to those chunks. Returns the slots freed.
        """
        keys = [key for key in self._resident if key[0] == session_id]
        for key in keys:
            self._free.append(self._resident.pop(key))
            self.stats.entries -= 1
            self.stats.bytes -= self._slot_bytes
        self._in_redis.difference_update([key for key in self._in_redis if key[0] == session_id])
        return len(keys)

    def persist(self, key: ChunkKey) -> bool:
        """Make sure Redis holds a copy of this chunk (chunks never change, so once is enough)."""
        if key in self._in_redis:
            return True
        if self.redis is None or key not in self._resident:
            return False
        if self.redis.put_chunk(*key, self._slots[self._resident[key]]):
            self._in_redis.add(key)
            return True
        return False

    def adopt(self, key: ChunkKey) -> None:
        """Record a chunk that Redis already holds (a session restored by another process)."""
        self._in_redis.add(key)

    def where(self, key: ChunkKey) -> str:
        if key in self._resident:
            return "host"
        return "redis" if key in self._in_redis else "none"

    def session_bytes(self, session_id: str) -> int:
        return self._slot_bytes * sum(1 for (sid, _) in self._resident if sid == session_id)
