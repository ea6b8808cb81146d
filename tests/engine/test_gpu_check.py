"""``make gpu-check`` on a CPU: its CUDA-only parts are recorded as skipped, the others run (tiny
e2e shapes, a 3-turn tiered conversation persisted to the suite's Redis) and every part's JSON and
the summary are written."""
import json

import pytest
import torch

from bench import gpu_check

pytestmark = pytest.mark.slow


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run of the check; `make gpu-check` runs it on a GPU")
def test_gpu_check_runs_its_cpu_parts_and_skips_the_cuda_ones(tmp_path, redis_url, capsys):
    assert gpu_check.main(["--out", str(tmp_path), "--quick", "--redis-url", redis_url]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    parts = summary["parts"]
    assert set(parts) == {"kernel_tests", "h2d", "ops", "e2e", "tiered_redis"}
    assert "no CUDA" in parts["kernel_tests"]["skipped"] and "no CUDA" in parts["h2d"]["skipped"]
    counts = json.loads((tmp_path / "ops.json").read_text())["counts"]["auto"]
    assert [r["sessions"] for r in counts] == [1, 4] and counts[0]["ops_per_layer"] == counts[1]["ops_per_layer"]
    e2e = json.loads((tmp_path / "e2e.json").read_text())
    assert {"rocketkv_over_full", "tiered_over_full"} <= set(e2e["speedups"])
    tiered = json.loads((tmp_path / "tiered_redis.json").read_text())
    turns = tiered["turns"]
    assert len(turns) == 3 and all(t["generated_tokens"] > 0 and t["ttft_ms"] > 0 for t in turns)
    assert turns[0]["host_bytes"] > 0  # the first message was longer than the budget: tokens went cold
    assert all(t["redis_bytes_written"] > 0 for t in turns) and tiered["redis_session_bytes_after_turn_3"] > 0
    assert turns[1]["prefilled_tokens"] < turns[0]["prefilled_tokens"]  # the cache was kept between turns
    out = capsys.readouterr().out
    assert "gpu-check summary" in out and "tiered_redis" in out
