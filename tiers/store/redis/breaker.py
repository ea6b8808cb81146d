"""A circuit breaker: whether calls to Redis go out now, so that a Redis that does not answer costs one
timeout, not one per call.

Closed, every call goes out. A connection failure or a timeout opens it: calls are refused at once
(the caller's ``RedisUnavailable``) until the backoff has passed; then one call goes out as the probe
while the others are still refused. The probe's success closes the circuit; its failure opens it again
for twice as long, up to ``most_s``. Any call that answers closes it (Redis is back). Its owner,
``tiers.store.redis.client.RedisClient``, asks it before every call and reports every outcome; every
thread calls through that client, so the state sits behind its own lock (never held across a call).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable


class CircuitBreaker:
    def __init__(self, first_s: float = 1.0, most_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self.first_s, self.most_s = first_s, max(first_s, most_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._state = "closed"  # "closed", "open" or "probing"
        self._backoff = first_s
        self._retry_at = 0.0
        self.opened = 0  # times the circuit opened (a metric)
        self.refused = 0  # calls refused while it was open (a metric)

    state = property(lambda self: self._state)

    def is_open(self) -> bool:
        """Whether a failure was the last word (open, or a probe out): Redis counts as unavailable."""
        return self._state != "closed"

    def blocked(self) -> bool:
        """Whether a call now would be refused: open with no probe due, or a probe already out."""
        with self._lock:
            return self._state == "probing" or (self._state == "open" and self._clock() < self._retry_at)

    def retry_in(self) -> float:
        """Seconds until the next probe may go out (0 when closed or due)."""
        with self._lock:
            return max(0.0, self._retry_at - self._clock()) if self._state == "open" else 0.0

    def admit(self) -> bool:
        """Whether this call may go out; an open circuit whose backoff has passed lets it out as the probe."""
        with self._lock:
            if self._state == "closed":
                return True
            if self._state == "open" and self._clock() >= self._retry_at:
                self._state = "probing"
                return True
            self.refused += 1
            return False

    def succeeded(self) -> None:
        with self._lock:
            self._state, self._backoff = "closed", self.first_s

    def failed(self) -> None:
        """A call found Redis unreachable: open (again). Only a failed probe doubles the backoff; calls that
        were already out when the circuit opened fail into the same backoff."""
        with self._lock:
            if self._state == "open":
                return
            if self._state == "probing":
                self._backoff = min(2 * self._backoff, self.most_s)
            else:
                self.opened += 1
            self._state, self._retry_at = "open", self._clock() + self._backoff

    def abandoned(self) -> None:
        """A probe ended without an answer either way (its caller was cancelled): the next call probes."""
        with self._lock:
            if self._state == "probing":
                self._state, self._retry_at = "open", self._clock()

    def as_dict(self) -> dict[str, int]:  # figures for ``/metrics``
        return {"redis_circuit_open": int(self.is_open()), "redis_circuit_opens": self.opened,
                "redis_calls_refused": self.refused}
