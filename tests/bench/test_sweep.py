"""Budget sweeps: eval files of one setup read as one table, ``full`` as the yardstick."""
from __future__ import annotations

from pathlib import Path

from bench import report
from bench.results import ROOT, Result, shipped
from bench.sweep import setup, sweeps

TASKS = "bench/tasks/ruler_6k.jsonl"


def run(correct: int, peak: float, total: int = 16) -> dict:
    return {"correct": correct, "total": total, "per_turn_accuracy": [correct / total], "peak_device_kv_bytes": peak,
            "mean_turn_latency_ms": 1.0, "per_kind": {"needles": {"correct": correct, "total": total}}}


def result(name: str, budget: int, modes: dict, threads: int = 2, extra_args: str = "", **extra) -> Result:
    command = (f"RKV_MODEL=bundled:qwen2.5-coder-0.5b RKV_THREADS={threads} rocketkv-mt eval --tasks {TASKS} "
               f"--modes {','.join(modes)} --budget {budget} --max-tokens 32{extra_args} --details "
               f"--json results/eval/{name}.json")
    data = {"command": command, "model": "bundled:qwen2.5-coder-0.5b", "budget": budget, "tasks": TASKS,
            "conversations": 16, "modes": modes, **extra}
    return Result(Path(f"/r/eval/{name}.json"), {k: v for k, v in data.items() if v is not None})


def test_the_setup_keeps_what_decides_the_replies_and_drops_what_names_the_runs():
    a = setup("RKV_MODEL=m RKV_THREADS=1 RKV_CACHE_DIR=x rocketkv-mt eval --tasks t --modes full --budget 256 "
              "--max-tokens 32 --details --quiet --json a.json")
    b = setup("RKV_MODEL=m RKV_THREADS=2 rocketkv-mt eval --tasks t --modes=tiered --budget=1024 --max-tokens 32 "
              "--json=b.json")
    assert a == b == "RKV_MODEL=m rocketkv-mt eval --tasks t --max-tokens 32"
    assert setup("RKV_RESELECT=exhaustive rocketkv-mt eval --tasks t --limit 4") != setup("rocketkv-mt eval --tasks t")


def test_modes_at_several_budgets_make_one_table_with_full_once_and_where_tiered_holds():
    found = sweeps([
        result("b256", 256, {"full": run(8, 100e6), "tiered": run(7, 25e6)}),
        result("b512", 512, {"tiered": run(5, 50e6), "snapkv": run(3, 20e6)}, threads=1),
        result("b1024", 1024, {"tiered": run(9, 80e6), "full": run(8, 100e6)}),
    ])
    assert len(found) == 1
    sweep = found[0]
    assert [(m, b) for m, b, _ in sweep.rows()] == [("full", None), ("snapkv", 512), ("tiered", 256),
                                                     ("tiered", 512), ("tiered", 1024)]
    assert sweep.within() == {256: True, 512: False, 1024: True}
    assert sweep.within(slack=0) == {256: False, 512: False, 1024: True}
    lines = report._sweep(sweep)
    assert "| `full` | - | 8 / 16 | 8 / 16 | 100.0 MB | 100% |" in lines
    assert "| `tiered` | 256 | 7 / 16 | 7 / 16 | 25.0 MB | 25% |" in lines
    assert lines[-2] == "`tiered` answers within one question of `full` at budget 256, 1024 (not at 512); " \
                        "the smallest: **256**."
    assert not sweep.disagreements


def test_runs_of_another_setup_or_incomplete_or_unnamed_make_no_sweep_together():
    one_budget = [result("a", 256, {"tiered": run(8, 1)}), result("b", 512, {"snapkv": run(2, 1)})]
    assert sweeps(one_budget) == []  # tiered and snapkv at one budget each, no full: nothing to compare
    assert len(sweeps([*one_budget, result("c", 256, {"full": run(8, 1)})])) == 1  # beside full, they are
    assert sweeps([result("c", 256, {"full": run(8, 1)})]) == []
    unnamed = [result("a", 256, {"tiered": run(8, 1)}, model=None), result("b", 512, {"tiered": run(8, 1)})]
    partial = [result("a", 256, {"tiered": run(8, 1)}, partial=True), result("b", 512, {"tiered": run(8, 1)})]
    limited = [result("a", 256, {"tiered": run(8, 1)}), result("b", 512, {"tiered": run(8, 1)}, extra_args=" --limit 4")]
    assert sweeps(unnamed) == [] and sweeps(partial) == [] and sweeps(limited) == []


def test_without_full_or_within_one_nowhere_or_other_questions_the_sweep_says_so():
    no_full = sweeps([result("a", 256, {"tiered": run(1, 1)}), result("b", 512, {"tiered": run(2, 1)})])[0]
    assert no_full.within() == {} and "no yardstick" in report._sweep(no_full)[-2]
    short = sweeps([result("a", 256, {"full": run(9, 1), "tiered": run(1, 1)}),
                    result("b", 512, {"tiered": run(2, 1)})])[0]
    assert "At no budget measured" in report._sweep(short)[-2]
    other = sweeps([result("a", 256, {"full": run(9, 1), "tiered": run(9, 1, total=20)})])[0]
    assert other.within() == {}  # 9 of 20 other questions says nothing against full's 9 of 16
    lines = report._sweep(other)
    assert "9 / 20 (not `full`'s questions)" in "\n".join(lines) and "did not run on `full`'s" in lines[-2]


def test_a_second_run_of_a_mode_and_budget_that_answers_differently_is_shown_not_hidden():
    sweep = sweeps([result("b1024", 1024, {"tiered": run(7, 1)}),
                    result("b256", 256, {"full": run(8, 1), "tiered": run(1, 1)}),
                    result("b256_again", 256, {"tiered": run(7, 1), "full": run(6, 1)}),
                    result("b512", 512, {"tiered": run(1, 1)})])[0]
    assert sweep.runs[("tiered", 256)].summary["correct"] == 1 and sweep.full.summary["correct"] == 8
    text = "\n".join(report._sweep(sweep))
    assert "`tiered` at 256 answered 7 / 16 in `/r/eval/b256_again.json`: the row is `/r/eval/b256.json`'s." in text
    assert "`full` answered 6 / 16 in `/r/eval/b256_again.json`" in text


def test_a_run_without_its_peak_bytes_is_shown_with_a_dash():
    bare = run(8, 0)
    del bare["peak_device_kv_bytes"]
    lines = report._sweep(sweeps([result("a", 256, {"full": run(8, 100e6), "tiered": bare})])[0])
    assert "| `tiered` | 256 | 8 / 16 | 8 / 16 | - | - |" in lines


def test_docs_ruler_md_holds_the_shipped_ruler_sweeps_as_the_report_writes_them():
    text = (ROOT / "docs" / "ruler.md").read_text()
    found = [s for s in sweeps(shipped()) if "bench/tasks/ruler_" in s.setup]
    assert found
    for sweep in found:
        table = [line for line in report._sweep(sweep) if line.startswith("|")]
        assert "\n".join(table) in text, sweep.setup
        assert report._verdict(sweep) in text
