"""How ``ServiceClient`` reaches chat replicas over Ray Serve: each call goes to the replica that
holds its session.

Calls carry the session id as ``multiplexed_model_id``, which ``SessionAffinityRouter`` keys on;
a replica (``api.deployment.ChatReplica``) answers every unary verb through one method, ``call``,
with ``outcome`` data, and streams turns through ``chat``. A call whose replica died (or that no
replica could take) fails with one of ``RETRYABLE``, and the client tries again: the router then
picks a survivor, which restores the session from Redis.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from ray import exceptions as ray_exceptions
from ray.serve import exceptions as serve_exceptions
from ray.serve.handle import DeploymentHandle

from app.contract.events import TurnEvent

RETRYABLE = tuple(
    exc
    for exc in (
        getattr(ray_exceptions, "RayActorError", None),
        getattr(ray_exceptions, "ActorUnavailableError", None),
        getattr(serve_exceptions, "BackPressureError", None),
        getattr(serve_exceptions, "DeploymentUnavailableError", None),
    )
    if exc is not None
)


class RayTransport:
    kind = "ray"
    fleet = True
    retryable = RETRYABLE

    def __init__(self, handle: DeploymentHandle):
        self.handle = handle

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def _to(self, sid: str, stream: bool = False):
        return self.handle.options(multiplexed_model_id=sid, stream=stream)

    async def call(self, sid: str, verb: str, *args: Any) -> dict[str, Any]:
        return await self._to(sid).call.remote(verb, *args)

    async def stream(self, sid: str, *args: Any) -> AsyncIterator[TurnEvent]:
        gen = self._to(sid, stream=True).chat.remote(*args)
        try:
            async for event in gen:
                yield event
        except RETRYABLE:
            # The replica is gone or unreachable: nothing to cancel. An attempt still running there
            # ends by itself and keeps its outcome for the retry, which carries the same turn key.
            raise
        except BaseException:
            gen.cancel()  # the caller left (or the stream broke): the replica's turn ends as cancelled
            raise
