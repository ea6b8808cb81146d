"""``bench.cluster_serve``'s pure parts: the budget that fits N sessions and not N+1, and a round's tally."""
from __future__ import annotations

import itertools

import pytest

from app.placement import Candidate, place
from bench.cluster_serve import REFUSED, budget_for, round_summary


def test_the_budget_fits_any_n_sessions_at_their_worst_and_no_n_plus_one_after_their_first_turn():
    worst = [300, 320, 310, 305]  # each session's largest commitment over its turns
    first = [280, 290, 285, 300]  # the least it commits once its first turn is admitted
    b = budget_for(worst, first, 2)
    assert b == {"budget": (630 + 855) // 2, "fits": 630, "overflow": 855}
    assert all(worst[i] + worst[j] <= b["budget"] for i, j in itertools.combinations(range(4), 2))
    assert all(sum(first[i] for i in trio) > b["budget"] for trio in itertools.combinations(range(4), 3))


def test_no_budget_when_n_sessions_may_commit_as_much_as_n_plus_one():
    with pytest.raises(ValueError, match="no budget tells them apart"):
        budget_for([500, 500, 500], [300, 300, 300], 2)


def test_a_round_counts_sessions_per_replica_and_refusals_and_checks_the_hash():
    replicas = ["a", "b"]
    ids = [f"s_{i}" for i in range(4)]
    hashed = {sid: place(sid, [Candidate(k) for k in replicas], "hash").key for sid in ids}
    records = [{"session_id": sid, "replica": hashed[sid], "turns": [{"code": None, "replica": hashed[sid]}]}
               for sid in ids]
    records[0]["turns"] = [{"code": REFUSED, "replica": None}]
    summary = round_summary(records, replicas, "hash")
    assert summary["split"] == [sum(1 for s in ids if hashed[s] == k) for k in replicas]
    assert summary["refused_sessions"] == 1 and summary["turns_done"] == 3
    assert summary["refused_per_replica"][replicas.index(hashed[ids[0]])] == 1
    assert summary["as_hashed"] and summary["other_errors"] == [] and summary["turns_on_another_replica"] == 0
    records[1]["replica"] = next(k for k in replicas if k != hashed[ids[1]])  # not where the hash puts it
    assert not round_summary(records, replicas, "hash")["as_hashed"]
    assert "as_hashed" not in round_summary(records, replicas, "memory")
