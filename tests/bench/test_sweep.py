"""Budget sweeps: eval files of one model and task file read as one table, ``full`` as the yardstick."""
from __future__ import annotations

from pathlib import Path

from bench import report
from bench.results import Result
from bench.sweep import sweeps

TASKS = "bench/tasks/ruler_6k.jsonl"


def run(correct: int, peak: float, kinds: dict | None = None) -> dict:
    return {"correct": correct, "total": 16, "per_turn_accuracy": [correct / 16], "peak_device_kv_bytes": peak,
            "mean_turn_latency_ms": 1.0, "per_kind": kinds or {"needles": {"correct": correct, "total": 16}}}


def result(name: str, budget: int, modes: dict, **extra) -> Result:
    data = {"model": "bundled:qwen2.5-coder-0.5b", "budget": budget, "tasks": TASKS, "conversations": 4,
            "modes": modes, **extra}
    return Result(Path(f"/r/eval/{name}.json"), {k: v for k, v in data.items() if v is not None})


def test_modes_at_several_budgets_make_one_table_with_full_once_and_the_parity_budget():
    found = sweeps([
        result("a", 256, {"full": run(8, 100e6), "tiered": run(5, 25e6)}),
        result("b", 512, {"tiered": run(7, 50e6), "snapkv": run(3, 20e6)}),
        result("c", 1024, {"tiered": run(9, 80e6), "full": run(8, 100e6)}),
    ])
    assert len(found) == 1
    sweep = found[0]
    assert [(m, b) for m, b, _ in sweep.rows()] == [("full", None), ("snapkv", 512), ("tiered", 256),
                                                     ("tiered", 512), ("tiered", 1024)]
    assert sweep.parity_budget() == 512  # 256 is three short of full's 8; 512 one short
    assert sweep.parity_budget(slack=0) == 1024
    lines = report._sweep(sweep)
    assert "| `full` | - | 8 / 16 | 8 / 16 | 100.0 MB | 100% |" in lines
    assert "| `tiered` | 256 | 5 / 16 | 5 / 16 | 25.0 MB | 25% |" in lines
    assert "**512**" in lines[-2]


def test_a_sweep_needs_full_or_two_budgets_and_complete_runs_that_name_their_model():
    one_budget = [result("a", 256, {"tiered": run(8, 1)}), result("b", 512, {"snapkv": run(2, 1)})]
    assert sweeps(one_budget) == []  # tiered and snapkv at one budget each, no full: nothing to compare
    assert len(sweeps([*one_budget, result("c", 256, {"full": run(8, 1)})])) == 1  # beside full, they are
    assert sweeps([result("c", 256, {"full": run(8, 1)})]) == []
    unnamed = [result("a", 256, {"tiered": run(8, 1)}, model=None), result("b", 512, {"tiered": run(8, 1)})]
    partial = [result("a", 256, {"tiered": run(8, 1)}, partial=True), result("b", 512, {"tiered": run(8, 1)})]
    assert sweeps(unnamed) == [] and sweeps(partial) == []
    other_tasks = [result("a", 256, {"tiered": run(8, 1)}), result("b", 512, {"tiered": run(8, 1)}, tasks="x")]
    assert sweeps(other_tasks) == []


def test_without_full_or_within_one_nowhere_the_sweep_says_so():
    no_full = sweeps([result("a", 256, {"tiered": run(1, 1)}), result("b", 512, {"tiered": run(2, 1)})])[0]
    assert no_full.parity_budget() is None and "no yardstick" in report._sweep(no_full)[-2]
    short = sweeps([result("a", 256, {"full": run(9, 1), "tiered": run(1, 1)}),
                    result("b", 512, {"tiered": run(2, 1)})])[0]
    assert short.parity_budget() is None and "At no budget measured" in report._sweep(short)[-2]


def test_a_later_file_replaces_an_earlier_run_of_the_same_mode_and_budget():
    sweep = sweeps([result("a", 256, {"full": run(8, 1), "tiered": run(1, 1)}),
                    result("b", 512, {"tiered": run(2, 1)}),
                    result("c", 256, {"tiered": run(7, 1)})])[0]
    assert sweep.runs[("tiered", 256)]["correct"] == 7 and sweep.parity_budget() == 256
