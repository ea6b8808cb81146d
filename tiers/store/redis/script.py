"""A Lua script on the keys of one slot, run on the node that holds them, on one Redis or a cluster.

redis-py's ``register_script`` answers a node that lacks the script with ``SCRIPT LOAD`` sent to every
primary of a cluster: that fails while any one of them is down (and a restarted node knows no script),
so a session's save on a live shard would fail for a dead one. Here EVALSHA goes to the keys' node and
a ``NOSCRIPT`` is answered by EVAL on that same node, which caches the script there.
"""
from __future__ import annotations

import hashlib
from typing import Any

from redis.exceptions import NoScriptError


class Script:
    def __init__(self, redis, text: str):
        self.redis = redis  # ``redis.asyncio.Redis`` or ``RedisCluster``
        self.text = text
        self.sha = hashlib.sha1(text.encode()).hexdigest()

    async def __call__(self, keys: list[str], args: list[Any]) -> Any:
        """Every key must hash to one slot (a cluster refuses the script otherwise: CROSSSLOT)."""
        try:
            return await self.redis.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await self.redis.eval(self.text, len(keys), *keys, *args)
