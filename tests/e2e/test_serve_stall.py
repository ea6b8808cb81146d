"""``bench serve --stall`` against an in-process server: sessions stream long replies while a long
message arrives (a first message, fed layer by layer, or a third turn, fed in chunks); they keep
streaming through its prefill, and the bench reports the gaps before, the longest pause during it
and their ratio."""
import argparse

import pytest
from serving_helpers import local_server

from bench.serve_stall import run

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("turn", [1, 3])
async def test_streams_go_on_while_a_long_message_is_prefilled(loaded, turn):
    args = argparse.Namespace(
        sessions=2, stall_tokens=400, stall_reply_tokens=600, stall_baseline=2.0, mode="rocketkv", budget=64,
        api_key=None, json_out=None, stall_turn=turn, stall_history=120, quiet=False,
    )
    with local_server(loaded, prefill_chunk=32) as server:
        args.url = server.url
        result = await run(args)
    assert result["errors"] == [] and result["streams_ended_during_prefill"] == 0
    long = result["long_message"]
    assert long["turn"] == turn and len(long["earlier_prompt_tokens"]) == turn - 1
    assert long["prefilled_tokens"] > 350
    during = result["server_during_prefill"]
    if turn == 1:  # a first message: fed layer by layer, in slices between the streams' steps
        pieces = during["batch_layered_slices"]
        assert during["batch_prefill_chunks"] == 0 and pieces >= 30
    else:  # a later one: in chunks of at most 32 tokens
        pieces = during["batch_prefill_chunks"]
        assert during["batch_layered_slices"] == 0 and pieces >= long["prefilled_tokens"] // 32 - 2
    # Both streams got tokens between the pieces: many gaps during the prefill, not one long pause each.
    assert result["gaps_during"] >= pieces // 2
    assert result["gap_before_p95_ms"] > 0 and result["baseline_gaps"] > 4
    assert result["max_pause_ms"] >= result["gaps_during_p95_ms"]
    assert result["ratio"] == pytest.approx(result["max_pause_ms"] / result["gap_before_p95_ms"], rel=0.01)
    # The longest pauses, longest first, the first being the max pause, each begun before the first token.
    pauses = result["longest_pauses"]
    assert 1 <= len(pauses) <= 5 and pauses[0]["ms"] == result["max_pause_ms"]
    assert [p["ms"] for p in pauses] == sorted((p["ms"] for p in pauses), reverse=True)
    assert all(p["at_s"] <= long["ttft_s"] for p in pauses)
