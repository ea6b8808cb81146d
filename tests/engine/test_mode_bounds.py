"""Every mode's declared device-memory bound holds: after every layer of every prefill and decode step
of a conversation, what the cache holds on the device is within the bound the memory model reserved
for that turn. Random attention inputs stand in for the model (``cache_drive``)."""
import pytest
import torch

from app.engine.memory import DeviceMemory
from app.engine.session import Session
from app.engine.steps import by_layer
from cache_drive import SPEC, forward, forward_layered, layer_inputs, tier_context
from rocketkv_mt.cache import CACHE_MODES, TierPolicy, cache_mode, make_cache
from rocketkv_mt.config import RocketKVConfig

TIER_POLICIES = {
    "digest": TierPolicy(page_tokens=8, reselect="digest"),  # the shipped candidates, pool and whole reads
    "ranked": TierPolicy(page_tokens=8, reselect="digest", read_whole=0),  # never read whole
    "half-reads": TierPolicy(page_tokens=8, reselect="digest", candidates=0.5, sketch_pool=9.0, read_whole=3.0),
    "bounds": TierPolicy(page_tokens=8, reselect="digest", page_grouping="keys", sketch_bits=0, read_whole=0),
    "exhaustive": TierPolicy(page_tokens=8, reselect="exhaustive"),
    "selected": TierPolicy(page_tokens=8, prefill_attention="selected"),
    "wide-digest": TierPolicy(page_tokens=4, reselect="digest", candidates=4.0),
    "sketch": TierPolicy(page_tokens=8, reselect="digest", page_grouping="position", sketch_bits=2, read_whole=0),
}
# (new tokens, max new tokens) per turn: a long first turn, short and long follow-ups, a reply longer
# than its prompt.
TURNS = [(180, 6), (30, 5), (120, 3), (4, 12)]
CASES = [(mode, "digest") for mode in sorted(CACHE_MODES)] + [("tiered", p) for p in TIER_POLICIES if p != "digest"]


def run_turn(
    memory: DeviceMemory, session: Session, gen: torch.Generator, n_new: int, max_new: int, chunk: int = 0
) -> tuple[int, int, int, int]:
    """One turn as the engine runs it (the last generated token is fed by the next turn's prefill), its
    prefill fed where the cache allows it layer by layer in groups of ``chunk`` rows (a first prompt
    longer than ``chunk``, or a later one where the mode feeds later turns so: ``tiered``), else in chunks of ``chunk`` tokens, the last one keeping at least a window
    (as ``app.engine.steps.piece`` splits it); returns (the mode's declared bound, the memory model's
    bound, the peak device bytes seen, the chunks or groups fed before the last)."""
    cache = session.cache
    turn = memory.turn_size(session, n_new, max_new, prefill_chunk=chunk)
    declared = cache_mode(session.mode).device_bound(turn, memory.tiers)
    reserved = memory.turn_bound(session, n_new, max_new, prefill_chunk=chunk)
    session.token_ids += [0] * n_new
    peak = [0]

    def measure(c):
        peak[0] = max(peak[0], c.device_bytes())

    fed = len(session.token_ids) - cache.history_len
    last, chunks = cache.last_chunk_min(), 0
    if by_layer(cache.history_len, fed, chunk, last is not None, cache.layers_later()):
        forward_layered(cache, layer_inputs(gen, fed), max_new=max_new, rows=chunk, on_group=measure)
        chunks, fed = SPEC.num_layers * -(-fed // chunk) - 1, 0
    while chunk and last is not None and fed > chunk and min(chunk, fed - last) > 0:
        n = min(chunk, fed - last)
        forward(cache, layer_inputs(gen, n), prefill=True, max_new=max_new, on_layer=measure, rest=fed - n)
        fed, chunks = fed - n, chunks + 1
    if fed:
        forward(cache, layer_inputs(gen, fed), prefill=True, max_new=max_new, on_layer=measure)
    session.token_ids.append(1)
    for _ in range(max_new - 1):
        forward(cache, layer_inputs(gen, 1), prefill=False, on_layer=measure)
        session.token_ids.append(1)
    cache.end_turn()
    measure(cache)
    return declared, reserved, peak[0], chunks


@pytest.mark.parametrize("mode,tiers", CASES)
@pytest.mark.parametrize("budget", [24, 4096])
@pytest.mark.parametrize("chunk", [0, 32])
def test_the_declared_bound_holds_at_every_step(mode, tiers, budget, chunk):
    policy = TIER_POLICIES[tiers]
    rocket = RocketKVConfig(token_budget=budget, window_size=8, kernel_size=5)
    memory = DeviceMemory(0, SPEC, policy)
    session = Session(id=f"bound-{mode}-{tiers}", mode=mode, rocket=rocket, cache=None)
    session.cache = make_cache(mode, SPEC, rocket, tier_context(policy, session.id))
    gen = torch.Generator().manual_seed(11)
    chunks = 0
    for n_new, max_new in TURNS:
        declared, reserved, peak, fed_in_chunks = run_turn(memory, session, gen, n_new, max_new, chunk)
        assert 0 < peak <= declared <= reserved, (n_new, max_new)
        chunks += fed_in_chunks
        memory.set_held(session.id, session.cache.device_bytes())
    assert memory.overruns == 0
    # A long first turn is fed layer by layer (nothing is cold yet), except where the new tokens attend
    # only to the selection their window makes.
    assert (chunks > 0) == (chunk > 0 and tiers != "selected")
    session.cache.release()

