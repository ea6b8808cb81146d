"""``bench rounds``: every model step of a phase is in its figures, and only those."""
import argparse

import pytest

from app.engine.steps import StepLog, StepRecord
from bench import rounds

pytestmark = pytest.mark.slow


async def test_each_phase_counts_exactly_the_steps_its_turns_ran(make_engine):
    engine = make_engine(mode="tiered", token_budget=64)
    args = argparse.Namespace(sessions=3, context=150, rounds=2, max_tokens=4, alone=1, mode=None, json_out=None)
    result = await rounds.run(args, engine)
    phases = [result["context_phase"], *result["rounds"], *result["alone"]]
    assert [p["turns"] for p in phases] == [3, 3, 3, 1]
    for p in phases:
        # Each turn's prompt is fed in prefill steps; its first token comes from its last prefill step and
        # every later one from a decode token.
        assert p["prefill_tokens"] == p["prefilled_tokens"] > 0
        assert p["decode_tokens"] == p["generated_tokens"] - p["turns"]
        assert p["prefill_s"] + p["decode_s"] <= p["wall_s"]
    assert result["rounds"][0]["mean_decode_batch"] > 1  # the round's sessions decoded together
    assert result["alone"][0]["mean_decode_batch"] in (None, 1.0)
    assert result["ratio"] > 0
    assert engine.batcher.step_log is None  # the engine is left as it was


def test_a_step_log_counts_past_what_it_keeps():
    log = StepLog(n=3)
    records = [StepRecord(i, 1, 0, 0.1) for i in range(5)]
    for r in records[:2]:
        log.add(r)
    start = len(log)
    for r in records[2:]:
        log.add(r)
    assert len(log) == 5
    assert log.since(start) == records[2:]  # the first two fell out of the log: the phase's three did not
    assert log.since(0) == records[2:]
