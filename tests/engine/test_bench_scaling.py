"""``bench scaling`` on a short history: every mode's three turns, repeated conversations reported as
medians, and one engine open at a time."""
import argparse
import json
import statistics

import pytest

from bench import scaling
from bench.common import Engines

pytestmark = pytest.mark.slow


def test_scaling_reports_medians_of_repeated_conversations(tmp_path, monkeypatch, capfd):
    open_engines = []
    alone = Engines.alone

    def spy(self, overrides):
        engine = alone(self, overrides)
        open_engines.append([e for e in self._engines.values() if not e.batcher._closed])
        return engine

    monkeypatch.setattr(Engines, "alone", spy)
    args = argparse.Namespace(lengths="400", modes="full,tiered-digest", budget=64, max_tokens=4, redis_url=None,
                              host_tier_bytes=None, repeats=2, json_out=str(tmp_path / "s.json"), plot=None,
                              quiet=False)
    assert scaling.main(args) == 0
    assert "bench scaling" not in capfd.readouterr().err  # stderr is no terminal here: no progress bar
    result = json.loads((tmp_path / "s.json").read_text())
    assert result["repeats"] == 2
    (row,) = result["lengths"]
    for mode in ("full", "tiered-digest"):
        turn3 = row["modes"][mode]["turn3"]
        assert len(turn3["ttft_ms_runs"]) == 2
        assert turn3["ttft_ms"] == round(statistics.median(turn3["ttft_ms_runs"]), 1)
    assert row["modes"]["full"]["turn3"]["ttft_vs_full"] == 1.0
    assert row["modes"]["tiered-digest"]["turn3"]["bytes_read"] > 0  # a 400-token history at budget 64 has cold pages
    assert len(open_engines) == 4 and all(len(engines) == 1 for engines in open_engines)
