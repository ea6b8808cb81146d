"""``bench capacity`` counts the sessions the device keeps: a run stops at the engine's first refusal
and says which memory refused it, the device's or the host tier's, with nothing left running."""
import pytest

from app.engine.sampling import SamplingParams
from bench.capacity import fill

pytestmark = pytest.mark.slow
PARAMS = SamplingParams(max_tokens=2)


@pytest.mark.parametrize("refused_by", ["device", "host"])
async def test_the_count_stops_at_the_first_refusal_and_names_the_memory(make_engine, refused_by):
    # A tiered session of a ~600-token history demotes about 20 MB of cold KV and holds a few MB on the
    # device: a 64 MiB host tier or a 40 MiB device budget each hold a few, the other memory plenty.
    tight = {"host": dict(host_tier_bytes=64 << 20, device_budget_bytes=1 << 30),
             "device": dict(host_tier_bytes=1 << 30, device_budget_bytes=40 << 20)}[refused_by]
    engine = make_engine(**tight)
    engine.parking = False
    figures = await fill(engine, "tiered", 600, 32, PARAMS, max_sessions=64)
    assert figures["refused_by"] == refused_by and figures["refused_next"]
    assert 0 < figures["sessions"] < 64
    assert len(engine.sessions) == figures["sessions"]  # the refused one was deleted
    assert engine.stats()["device_reservation_overruns"] == 0
