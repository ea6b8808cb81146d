"""``bench placement`` in small: a skewed trace (long documents arriving at once) on a few simulated
replicas, placement by memory against hashing, and the report's table of a result."""
from __future__ import annotations

from argparse import Namespace

from bench.placement import run_grid, scenarios
from bench.placement_sim import SimConfig, Simulation
from bench.placement_trace import TraceShape, synthetic_trace, trace_figures
from bench.report import TABLES
from bench.results import kind

GIB = 1024**3
# Everyone opens with a ~8k-token document within 20 s, half of them in `full`; turns that do not fit are
# refused at once (no admission wait), so an uneven split shows as refusals.
SKEWED = TraceShape(rate=0.5, duration_s=20, burst_at=0, burst_s=20, burst_factor=1, doc_share=1.0,
                    doc_median=8000, doc_sigma=0.25, think_median_s=5, full_share=0.5)
BASE = SimConfig(replicas=1, device_budget=8 * GIB, admission_wait_s=0)


def test_memory_placement_refuses_no_more_than_hashing_on_a_skewed_trace():
    runs = run_grid([8], ["hash", "memory"], SKEWED, BASE, seed=1)["8"]["policies"]
    hashed, memory = runs["hash"], runs["memory"]
    assert hashed["refused"] > 0  # the trace is skewed enough for hashing to overload a replica
    assert memory["refused"] <= hashed["refused"]
    assert memory["reprefill_tokens"] <= hashed["reprefill_tokens"]
    assert memory["device_active_busiest"] < hashed["device_active_busiest"]


def test_the_simulated_sessions_stay_within_their_turns_reservations():
    trace = synthetic_trace(TraceShape(rate=0.6, duration_s=120), seed=2)
    for moves in (False, True):
        sim = Simulation(SimConfig(replicas=3, device_budget=2 * GIB, moves=moves), trace)
        counts = sim.run()
        total = sum(len(c.turns) for c in trace)
        assert counts.turns == total if not counts.refused else counts.turns < total  # a refusal ends its chat
        assert counts.parks > 0  # the budget was tight enough to park
        for replica in sim.replicas:
            assert replica.memory_account.overruns == 0  # the bound held for every simulated turn
            assert not replica.waiting and not replica.memory_account.reserved
        assert (counts.moves > 0) == moves


def test_the_trace_matches_its_published_shape():
    figures = trace_figures(synthetic_trace(TraceShape(rate=5.0, duration_s=600, doc_share=0.0), seed=0))
    assert 2.4 <= figures["mean_turns"] <= 3.4  # LMSYS-Chat-1M 2.0, ShareGPT 3.5
    assert 55 <= figures["mean_prompt_tokens"] <= 100  # 69.5 and 94.9
    assert 190 <= figures["mean_reply_tokens"] <= 300  # 214.5 and 348.5, cut at max_new
    assert 35 <= figures["mean_gap_s"] <= 65


def test_a_result_is_recognised_and_tabled():
    args = Namespace(rate=0.2, duration=30.0, doc_share=0.1, full_share=0.2, max_new=512, burst_rate=0.3,
                     burst_duration=10.0, burst_doc=4000.0, scenarios="chat,burst")
    shapes = scenarios(args)
    result = {"placement": {"sim": {"device_budget": 8 * GIB, "token_budget": 256, "admission_wait_s": 60.0,
                                    "report_s": 2.0, "prefill_tps": 8000.0, "decode_tps": 30.0},
                            "model": "m", "seed": 0, "scenarios": {n: vars(s) for n, s in shapes.items()}},
              "replica_counts": [2],
              "scenarios": {n: run_grid([2], ["hash", "memory"], s, BASE, 0) for n, s in shapes.items()}}
    assert kind(result) == "placement"
    text = "\n".join(TABLES["placement"](result))
    assert "| 2 | `hash` |" in text and "| 2 | `memory` |" in text and "`burst`" in text
