"""Redis tier: raw tensor bytes plus a JSON header per key (never pickle), namespaced, with an idle TTL.

The client is redis-py's asyncio client, driven from a private event-loop thread, so the tier can be
used from the model thread (blocking calls with a timeout) and from async code alike. Failures are
counted and reported (``healthy``/``last_error``); they are never raised into a chat turn.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Coroutine
from typing import Any

import torch

from tiers.base import PageBatch, TierStats

log = logging.getLogger(__name__)
_DTYPES = {
    str(t).removeprefix("torch."): t
    for t in (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool, torch.int32, torch.uint8, torch.int8)
}


def encode_tensors(tensors: dict[str, torch.Tensor], meta: dict | None = None) -> tuple[bytes, bytes]:
    """(JSON header, raw bytes): header lists each tensor's dtype, shape and byte offset."""
    header, blobs, offset = {"tensors": {}, "meta": meta or {}}, [], 0
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header["tensors"][name] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "offset": offset, "nbytes": len(raw)}
        blobs.append(raw)
        offset += len(raw)
    return json.dumps(header).encode(), b"".join(blobs)


def decode_tensors(header: bytes, data: bytes) -> tuple[dict[str, torch.Tensor], dict]:
    """Inverse of ``encode_tensors``; rejects unknown dtypes and inconsistent sizes."""
    head = json.loads(header)
    out = {}
    for name, spec in head["tensors"].items():
        dtype = _DTYPES.get(spec["dtype"])
        if dtype is None:
            raise ValueError(f"unsupported dtype {spec['dtype']!r} in tensor header")
        start, n = int(spec["offset"]), int(spec["nbytes"])
        raw = bytearray(data[start : start + n])
        if len(raw) != n:
            raise ValueError("tensor data shorter than its header says")
        flat = torch.frombuffer(raw, dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
        out[name] = flat.view(dtype).reshape(spec["shape"]).clone()
    return out, head.get("meta", {})


class RedisTier:
    def __init__(self, url: str, namespace: str = "rkv", ttl_s: int = 86400, timeout_s: float = 2.0):
        import redis.asyncio as aioredis

        self.url, self.ns, self.ttl_s, self.timeout_s = url, namespace, ttl_s, timeout_s
        self.stats = TierStats()
        self.healthy = True
        self.last_error: str | None = None
        self._sizes: dict[str, int] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rkv-redis", daemon=True)
        self._thread.start()
        self._client = aioredis.Redis.from_url(
            url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s, decode_responses=False
        )

    # --- keys --------------------------------------------------------------------------------
    def chunk_key(self, session_id: str, chunk_id: str) -> str:
        return f"{self.ns}:session:{session_id}:kv:{chunk_id}"

    def meta_key(self, session_id: str) -> str:
        return f"{self.ns}:session:{session_id}:meta"

    # --- plumbing ----------------------------------------------------------------------------
    def _run(self, coro: Coroutine[Any, Any, Any], default=None):
        """Run on the tier's loop and wait; on failure record it and return ``default``."""
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            result = fut.result(self.timeout_s * 3)
        except Exception as exc:  # noqa: BLE001 - any Redis failure degrades the tier, never the turn
            fut.cancel()
            self.stats.errors += 1
            self.healthy = False
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.warning("redis tier error: %s", self.last_error)
            return default
        self.healthy = True
        return result

    def ping(self) -> bool:
        return bool(self._run(self._client.ping(), default=False))

    # --- tensors -----------------------------------------------------------------------------
    def put_pages(self, session_id: str, pages: dict[str, PageBatch]) -> bool:
        """Store pages (id -> its tensors, no page axis) in one pipelined request; False on failure."""
        if not pages:
            return True
        encoded = {self.chunk_key(session_id, pid): encode_tensors(t) for pid, t in pages.items()}

        async def op():
            async with self._client.pipeline(transaction=False) as pipe:
                for key, (header, data) in encoded.items():
                    pipe.hset(key, mapping={"header": header, "data": data})
                    pipe.expire(key, self.ttl_s)
                await pipe.execute()
            return True

        if not self._run(op(), default=False):
            return False
        for key, (_, data) in encoded.items():
            self._account_write(key, len(data))
        return True

    def get_pages(self, session_id: str, page_ids: list[str]) -> list[PageBatch | None]:
        """Pages by id in one pipelined request; None where a page is missing or Redis is down."""
        if not page_ids:
            return []
        keys = [self.chunk_key(session_id, pid) for pid in page_ids]

        async def op():
            async with self._client.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.hmget(key, ["header", "data"])
                    pipe.expire(key, self.ttl_s)
                return (await pipe.execute())[::2]

        replies = self._run(op(), default=None) or [(None, None)] * len(keys)
        out: list[PageBatch | None] = []
        for header, data in replies:
            if header is None:
                self.stats.misses += 1
                out.append(None)
                continue
            out.append(decode_tensors(header, data)[0])
            self.stats.hits += 1
            self.stats.promotions += 1
            self.stats.bytes_read += len(data)
        return out

    def has_pages(self, session_id: str, page_ids: list[str]) -> bool:
        """Whether Redis holds every one of these pages (one pipelined request; False if Redis is down)."""
        keys = [self.chunk_key(session_id, pid) for pid in page_ids]

        async def op():
            async with self._client.pipeline(transaction=False) as pipe:
                for i in range(0, len(keys), 512):
                    pipe.exists(*keys[i : i + 512])
                return sum(await pipe.execute())

        return not keys or self._run(op(), default=-1) == len(keys)

    def _account_write(self, key: str, nbytes: int) -> None:
        if key not in self._sizes:
            self.stats.entries += 1
            self.stats.demotions += 1
        self.stats.bytes += nbytes - self._sizes.get(key, 0)
        self.stats.bytes_written += nbytes
        self._sizes[key] = nbytes

    def delete_pages(self, session_id: str, page_ids: list[str]) -> None:
        keys = [self.chunk_key(session_id, pid) for pid in page_ids]
        if not keys or self._run(self._client.delete(*keys), default=None) is None:
            return
        for key in keys:
            if key in self._sizes:
                self.stats.bytes -= self._sizes.pop(key)
                self.stats.entries -= 1

    # --- session metadata --------------------------------------------------------------------
    def put_meta(self, session_id: str, meta: dict) -> bool:
        key = self.meta_key(session_id)
        return bool(self._run(self._client.set(key, json.dumps(meta).encode(), ex=self.ttl_s), default=False))

    def get_meta(self, session_id: str) -> dict | None:
        raw = self._run(self._client.get(self.meta_key(session_id)), default=None)
        return json.loads(raw) if raw else None

    def delete_session(self, session_id: str) -> None:
        async def op():
            keys = [k async for k in self._client.scan_iter(match=f"{self.ns}:session:{session_id}:*")]
            if keys:
                await self._client.delete(*keys)

        self._run(op())
        prefix = f"{self.ns}:session:{session_id}:"
        for key in [k for k in self._sizes if k.startswith(prefix)]:
            self.stats.bytes -= self._sizes.pop(key)
            self.stats.entries -= 1

    def session_bytes(self, session_id: str) -> int:
        prefix = f"{self.ns}:session:{session_id}:"
        return sum(n for k, n in self._sizes.items() if k.startswith(prefix))

    def close(self) -> None:
        self._run(self._client.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
