"""Device-memory accounting across the two threads that touch a session's cache."""
import threading
from types import SimpleNamespace

from cache_drive import SPEC
from app.engine.memory import DeviceMemory


class SlowCache:
    """A cache whose measure blocks until let go, to hold a measure open while the cache is taken."""

    def __init__(self):
        self.entered, self.release = threading.Event(), threading.Event()

    def device_bytes(self) -> int:
        self.entered.set()
        assert self.release.wait(5)
        return 1000


def test_a_cache_taken_while_it_is_measured_leaves_its_session_holding_nothing():
    mem = DeviceMemory(0, SPEC)
    cache = SlowCache()
    session = SimpleNamespace(id="s", cache=cache)
    measuring = threading.Thread(target=mem.measure, args=(session,))  # the model thread, after a step
    measuring.start()
    assert cache.entered.wait(5)
    taken = []
    taking = threading.Thread(target=lambda: taken.append(mem.take_cache(session)))  # the event loop, parking it
    taking.start()
    cache.release.set()
    measuring.join(5)
    taking.join(5)
    # The measure begun first ends first; the take then leaves 0, not the size measured before it.
    assert taken == [cache] and session.cache is None and mem.held["s"] == 0
    mem.measure(session)  # a later measure of a session without a cache writes nothing
    assert mem.held["s"] == 0 and mem.observe(["s"]) == 0
