"""``bench turn-profile`` on tiny shapes on the CPU: each mode's later turn is timed and profiled, its
functions listed by self time, and the report reads it as tables."""
import argparse
import json

from bench import report, turn_profile
from bench.results import load


def test_each_mode_s_later_turn_is_timed_and_its_functions_listed_by_self_time(tmp_path):
    out = tmp_path / "gpu" / "turn_profile.json"
    args = argparse.Namespace(context=300, modes="rocketkv,tiered", shapes="tiny,num_hidden_layers=3", device="cpu",
                              budget=32, max_new=16, second_turn=8, rows=64, json_out=str(out))
    assert turn_profile.main(args) == 0
    result = json.loads(out.read_text())
    assert set(result["modes"]) == {"rocketkv", "tiered"}
    for m in result["modes"].values():
        assert m["ttft_second_turn_ms"] > 0 and m["python_calls"] > 0
        top = [f["self_ms"] for f in m["top"]]
        assert 0 < len(top) <= turn_profile.TOP and top == sorted(top, reverse=True)
        assert all(f["cumulative_ms"] >= f["self_ms"] and f["calls"] >= 1 for f in m["top"])
    # tiered reads its cold pages on a later turn: more code than rocketkv runs.
    assert result["modes"]["tiered"]["python_calls"] > result["modes"]["rocketkv"]["python_calls"]
    text = "\n".join(report.TABLES[load(out).bench](result))
    first = result["modes"]["tiered"]["top"][0]
    assert "| `tiered` |" in text and f"| `{first['function']}` | {first['calls']} |" in text
