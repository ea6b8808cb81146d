"""The renewal of what an engine wrote to the store and no record names yet (``tiers.host.copies``: pages
spilled, generations whose record has not committed): every quarter of the short TTL, on a thread of its
own, for as long as the engine lives. So it is the holder of the pages that keeps them, whoever serves
the engine (a service, a benchmark), and a cut from Redis shorter than three quarters of the TTL loses
nothing: what a replica that died or stopped renewing wrote expires on its own.
"""
from __future__ import annotations

import logging
import threading

from tiers.host.tier import HostTier

log = logging.getLogger(__name__)


class PendingRenewal:
    def __init__(self, host: HostTier, every_s: float):
        self.host, self.every_s = host, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rkv-renewal", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.host.renew_pending()
            except Exception as exc:  # noqa: BLE001 - tried again at the next beat
                log.info("renewing pending KV: %s: %s", type(exc).__name__, exc)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
