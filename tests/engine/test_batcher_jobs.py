"""Jobs on the model thread run in order between steps; one that waits for a cache the page reader is
still settling waits off that thread, while steps run (a runner that records its steps stands in for
the model)."""
import asyncio
import threading

import pytest

from app.engine.batcher import Batcher, EngineClosed
from test_batcher_arrivals import GREEDY, Cache, RecordingRunner


class SettlingCache(Cache):
    """A cache whose last layer settles on the page reader until ``settled`` is set."""

    def __init__(self):
        self.settled = threading.Event()

    def decode_ready(self) -> bool:
        return self.settled.is_set()


async def test_a_job_after_a_settling_cache_waits_while_steps_run_and_jobs_keep_their_order():
    runner = RecordingRunner(step_s=0.002)
    batcher = Batcher(runner)
    cache, ran = SettlingCache(), []
    try:
        first = batcher.submit(lambda: ran.append("after"), after=cache)
        second = batcher.submit(lambda: ran.append("behind"))
        for i in range(20):  # another session decodes on meanwhile
            await batcher.decode("s", Cache(), i, GREEDY)
        assert ran == [] and not first.done() and not second.done()
        cache.settled.set()
        await asyncio.wrap_future(second)
        assert ran == ["after", "behind"]
        # With nothing else to run, a job waiting for its cache runs soon after the cache is ready.
        late = SettlingCache()
        job = batcher.submit(lambda: ran.append("idle"), after=late)
        await asyncio.sleep(0.05)
        assert not job.done()
        late.settled.set()
        await asyncio.wait_for(asyncio.wrap_future(job), 5)
        assert ran[-1] == "idle"
    finally:
        batcher.close()
    assert len(runner.steps) >= 20


async def test_closing_fails_a_job_still_waiting_for_its_cache():
    batcher = Batcher(RecordingRunner())
    job = batcher.submit(lambda: "ran", after=SettlingCache())
    await asyncio.sleep(0.02)
    batcher.close()
    with pytest.raises(EngineClosed):
        job.result(timeout=5)
