"""``make gpu-check`` on a CPU: its CUDA-only parts are recorded as skipped, the others run (tiny
e2e shapes, a 3-turn tiered conversation persisted to the suite's Redis) and every part's JSON and
the summary are written."""
import json
import weakref

import pytest
import torch

from bench import gpu_check

pytestmark = pytest.mark.slow


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run of the check; `make gpu-check` runs it on a GPU")
def test_gpu_check_runs_its_cpu_parts_and_skips_the_cuda_ones(tmp_path, redis_url, capsys):
    assert gpu_check.main(["--out", str(tmp_path), "--quick", "--redis-url", redis_url]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    parts = summary["parts"]
    assert set(parts) == {"kernel_tests", "h2d", "ops", "e2e", "prefill_peak", "tiered_redis", "turn_profile"}
    assert set(json.loads((tmp_path / "turn_profile.json").read_text())["modes"]) == {"rocketkv", "tiered"}
    assert "no CUDA" in parts["kernel_tests"]["skipped"] and "no CUDA" in parts["h2d"]["skipped"]
    counts = json.loads((tmp_path / "ops.json").read_text())["counts"]["auto"]
    assert [r["sessions"] for r in counts] == [1, 4] and counts[0]["ops_per_layer"] == counts[1]["ops_per_layer"]
    peaks = json.loads((tmp_path / "prefill_peak.json").read_text())["modes"]
    assert set(peaks) == {"full", "rocketkv", "tiered"}
    for row in peaks.values():
        assert 0 < row["peak_session_bytes"] <= row["admission_bound_bytes"] < row["peak_with_scratch_bytes"]
    assert peaks["tiered"]["peak_session_bytes"] < peaks["full"]["peak_session_bytes"]
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
    assert len(list(tmp_path.iterdir())) <= 8  # all a lent machine sends back


def test_a_part_whose_estimate_no_longer_fits_is_skipped_not_started(tmp_path, monkeypatch, capsys):
    started = []
    monkeypatch.setattr(gpu_check, "PARTS", {"e2e": lambda a: started.append("e2e") or {"skipped": "stand-in"},
                                             "prefill_peak": lambda a: started.append("p") or {"skipped": "x"},
                                             "kernel_tests": lambda a: started.append("k") or {"skipped": "stand-in"},
                                             "tiered_redis": lambda a: started.append("t") or {"skipped": "x"},
                                             "h2d": lambda a: started.append("h") or {"skipped": "x"},
                                             "ops": lambda a: started.append("o") or {"skipped": "x"}})
    monkeypatch.setattr(gpu_check, "estimates", lambda args: {"e2e": 1.0, "prefill_peak": 1.0, "kernel_tests": 500.0,
                                                              "tiered_redis": 1.0, "h2d": 1.0, "ops": 1.0})
    assert gpu_check.main(["--out", str(tmp_path), "--budget-s", "100"]) == 0
    assert started == ["e2e", "p", "t", "h", "o"]
    parts = json.loads((tmp_path / "summary.json").read_text())["parts"]
    assert parts["kernel_tests"]["skipped"].startswith("no time left: 500 s estimated")


def test_the_estimate_of_the_e2e_part_fits_its_budget_on_the_lent_chips():
    from bench import gpu_estimate
    from bench.random_model import LLAMA_31_8B

    for chip in ("h200", "h100"):
        e2e = gpu_estimate.e2e_s(LLAMA_31_8B, [32768, 131072], [1, 8], ["full", "rocketkv", "tiered"], 256, 10, 2, 2,
                                 gpu_estimate.CHIPS[chip])
        peak = gpu_estimate.first_turns_s(LLAMA_31_8B, 131072, 3, gpu_estimate.CHIPS[chip])
        assert gpu_estimate.check_s(e2e, peak)["total"] < 480
        # A 4x longer prompt costs more than 4x (attention is quadratic) and less than 16x.
        assert 4 * e2e["prefill_32768"] < e2e["prefill_131072"] < 16 * e2e["prefill_32768"]
    # full at 128k and batch 8 needs 128 GiB of KV: skipped, as the bench skips it.
    small = gpu_estimate.e2e_s(LLAMA_31_8B, [131072], [8], ["full"], 256, 10, 2, 2, gpu_estimate.CHIPS["h100"])
    assert small["decode_131072"] == 0


def _parts(**over):
    return {name: over.get(name, lambda a: {"skipped": "x"})
            for name in gpu_check.PARTS}


def test_a_failed_part_leaves_nothing_alive_for_the_next(tmp_path, monkeypatch):
    class Held:  # stands for a tensor the failed part held in a reference cycle
        pass

    refs, seen = [], []

    def fails(args):
        held = Held()
        held.cycle = held
        refs.append(weakref.ref(held))
        raise RuntimeError("out of memory")

    monkeypatch.setattr(gpu_check, "PARTS", _parts(e2e=fails, prefill_peak=lambda a: seen.append(refs[0]()) or
                                                   {"skipped": "x"}))
    monkeypatch.setattr(gpu_check, "estimates", lambda args: dict.fromkeys(gpu_check.PARTS, 0.0))
    assert gpu_check.main(["--out", str(tmp_path)]) == 1
    assert seen == [None]
    assert "out of memory" in json.loads((tmp_path / "summary.json").read_text())["parts"]["e2e"]["error"]


def test_failed_kernel_tests_are_reported_as_failed_not_skipped(tmp_path, monkeypatch):
    counts = {"tests": 3, "failures": 1, "errors": 0, "skipped": 0, "passed": 2, "failed": ["t::a"]}
    monkeypatch.setattr(gpu_check, "PARTS", _parts(kernel_tests=lambda a: counts))
    monkeypatch.setattr(gpu_check, "estimates", lambda args: dict.fromkeys(gpu_check.PARTS, 0.0))
    assert gpu_check.main(["--out", str(tmp_path)]) == 1
    entry = json.loads((tmp_path / "summary.json").read_text())["parts"]["kernel_tests"]
    assert "skipped" not in entry and entry["headline"].startswith("2/3 passed; FAILED")
