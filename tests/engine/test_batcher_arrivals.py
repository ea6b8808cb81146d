"""An idle engine's first step waits for the turns that arrive with the first one (the step
composition is pure bookkeeping: a runner that records its steps stands in for the model)."""
import asyncio
import time

import pytest
import torch

from app.engine import batcher as batcher_module
from app.engine.batcher import Batcher
from app.engine.sampling import plain_sampler

GREEDY = plain_sampler()


class Cache:
    """What the batcher asks of a cache for a prefill fed whole."""

    def unselected_layers(self) -> int:
        return 0

    def decode_ready(self) -> bool:
        return True


class RecordingRunner:
    device = torch.device("cpu")

    def __init__(self, step_s: float = 0.0):
        self.step_s = step_s
        self.steps: list[list[int]] = []  # per step, the tokens of each segment

    def step(self, segments):
        self.steps.append([len(s.ids) for s in segments])
        time.sleep(self.step_s)
        return torch.zeros(len(segments), 4), {}


async def staggered_turns(batcher: Batcher, count: int, gap_s: float) -> None:
    async def turn(i):
        await asyncio.sleep(gap_s * i)
        return await batcher.prefill(f"s{i}", Cache(), [1] * (i + 1), 4, GREEDY)

    await asyncio.gather(*(turn(i) for i in range(count)))


@pytest.mark.parametrize("wait", [True, False], ids=["arrival-wait", "no-wait"])
async def test_turns_arriving_together_at_an_idle_engine_share_its_first_step(monkeypatch, wait):
    # Turns 5 ms apart: with a quiet period of 50 ms the first step waits for all of them; without the
    # wait the first turn takes a step alone while the others queue behind it.
    monkeypatch.setattr(batcher_module, "ARRIVAL_QUIET_S", 0.05)
    monkeypatch.setattr(batcher_module, "ARRIVAL_MAX_S", 1.0 if wait else 0.0)
    runner = RecordingRunner(step_s=0.1)
    batcher = Batcher(runner)
    try:
        await staggered_turns(batcher, 6, gap_s=0.005)
    finally:
        batcher.close()
    if wait:
        assert runner.steps == [[1, 2, 3, 4, 5, 6]]
    else:
        assert runner.steps[0] == [1] and len(runner.steps) >= 2
        assert sorted(n for step in runner.steps for n in step) == [1, 2, 3, 4, 5, 6]


async def test_the_arrival_wait_ends_at_its_limit_while_turns_keep_coming(monkeypatch):
    # A turn every 5 ms for ~0.2 s, quiet period 50 ms, limit 40 ms: the first step starts by the limit,
    # with the turns that came by then, not with all of them.
    monkeypatch.setattr(batcher_module, "ARRIVAL_QUIET_S", 0.05)
    monkeypatch.setattr(batcher_module, "ARRIVAL_MAX_S", 0.04)
    runner = RecordingRunner()
    batcher = Batcher(runner)
    try:
        await staggered_turns(batcher, 40, gap_s=0.005)
    finally:
        batcher.close()
    assert 2 <= len(runner.steps[0]) < 40
    assert sorted(n for step in runner.steps for n in step) == list(range(1, 41))
