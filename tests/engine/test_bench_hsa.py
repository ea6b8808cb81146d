"""``bench hsa --sessions``: the native batched step over sessions and layers that each own their
buffers (the rows point into them, so they must outlive every call)."""
import json

import pytest

from cli.main import build_parser
from rocketkv_mt.native import library


@pytest.mark.skipif(library() is None, reason="no C compiler: the native kernel is not built")
def test_bench_hsa_times_the_batched_step_per_session_and_layer(tmp_path):
    out = tmp_path / "hsa.json"
    args = build_parser().parse_args(
        ["bench", "hsa", "--kept", "200", "--context", "400", "--page-size", "2", "--topr", "16", "--topk", "64",
         "--calls", "2", "--rounds", "2", "--sessions", "3", "--layers", "4", "--json", str(out)])
    assert args.func(args) == 0
    batched = json.loads(out.read_text())["batched"]
    assert (batched["sessions"], batched["layers"]) == (3, 4)
    # One step's time over its 12 calls' sessions and layers (each figure rounded: 0.01 ms, 0.1 us).
    assert batched["us_per_session_layer"] > 0
    assert abs(batched["us_per_session_layer"] * 12 - batched["step_ms"] * 1000) <= 6
